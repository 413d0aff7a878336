"""stages: one module per DVC stage, run as ``python -m trainyard.stages.<name>``."""
