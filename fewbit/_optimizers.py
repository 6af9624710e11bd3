"""Optimizer names the planner and the ``fewbit plan`` command know (standard library only,
so the CLI can list them without importing torch)."""

from __future__ import annotations

#: Optimizer state per parameter, in multiples of the parameter's bytes (AdamW/Adam: two
#: moments; SGD with momentum: one buffer; plain SGD and "none": nothing).
OPTIMIZER_STATES: dict[str, int] = {"adamw": 2, "adam": 2, "sgd": 0, "sgd_momentum": 1, "none": 0}
