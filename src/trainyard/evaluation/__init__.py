"""evaluation: the exported ONNX model on the test set (scoring), and the pictures of it."""
