"""fewbit.ops: kernels for few-bit activations (placeholder, being written)."""
