"""fewbit.quant: group quantizer for saved tensors (placeholder, being written)."""
