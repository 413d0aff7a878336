"""bulk: score many images at once (``trainyard predict``), and merge the shards of a job.

Reads the runtime (ONNX Runtime sessions, the service's decode) and the data layer's folder
walk, never the service: a bulk answer and a served answer for one file are the same
numbers. No torch, no MLflow: ``python -m trainyard.bulk`` runs where the service runs.
"""
