"""The ``fewbit memory`` command (placeholder, being written)."""

import click


@click.command("memory")
def memory() -> None:
    """Report the memory saved for backward (being written)."""
    raise click.ClickException("fewbit memory is not available yet")
