"""track: MLflow plumbing (runs, lineage, system metrics), the model registry, and the typed
records stages hand to each other (models/train.json, reports/export.json, registry.json).
"""
