"""export: ONNX export with its parity check against PyTorch, and evaluation of the ONNX model."""
