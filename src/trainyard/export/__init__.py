"""export: ONNX export with its parity check against PyTorch."""
