"""fewbit.solver: offline fitting of few-bit tables (placeholder, being written)."""
