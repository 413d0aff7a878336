"""runtime: ONNX Runtime sessions (provider choice) and request inputs -> model inputs.

No torch: the service, export parity and evaluation all run models through it.
"""
