"""Argument checks shared by the scripts, without torch (``summarize_runs.py`` starts fast)."""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path


def new_file(s: str) -> str:
    """An argparse type for an output file (``--json``): a path in an existing directory
    where nothing is yet (a result the user had is not overwritten; the run is long)."""
    if not s:
        raise argparse.ArgumentTypeError("must be a file path, got ''")
    parent = os.path.dirname(os.path.abspath(s))
    if not os.path.isdir(parent):
        raise argparse.ArgumentTypeError(f"directory {parent!r} does not exist (for {s!r})")
    if os.path.lexists(s):
        raise argparse.ArgumentTypeError(f"{s!r} exists; remove it or give another path")
    return s


def out_dir(p: argparse.ArgumentParser, path: Path, option: str = "--out") -> Path:
    """Make the output directory ``path`` now, before any run (``p.error`` in one line on a
    file there or an OS error: found after the whole run, it had lost the results)."""
    if path.exists() and not path.is_dir():
        p.error(f"{option} {path} is a file, not a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        p.error(f"{option} {path}: {exc.strerror or exc}")
    return path


#: The suffix of a run's variant in its CSV name (:func:`run_tag`).
_TAG = re.compile(r"(_g\d+)?(_draw\d+)?$")


def run_tag(group_size: int, noise_draw: int) -> str:
    """The suffix ``train_*.py`` adds to a variant's name in its CSV file: ``_g<size>`` for
    a group size other than 256, ``_draw<K>`` for a noise draw K > 0 (``summarize_runs``
    reads it back with :func:`split_tag`)."""
    tag = "" if group_size == 256 else f"_g{group_size}"
    return tag + (f"_draw{noise_draw}" if noise_draw else "")


def split_tag(variant: str) -> tuple[str, str]:
    """``(variant, tag)`` of a CSV name's variant: ``"gact2_g64"`` -> ``("gact2", "_g64")``."""
    tag = _TAG.search(variant).group(0)
    return (variant[: len(variant) - len(tag)], tag) if tag else (variant, "")
