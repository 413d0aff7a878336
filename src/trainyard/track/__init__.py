"""track: the only package that imports MLflow. Runs (store, lineage, system metrics), the
training run (train_run), a tune study's runs (study_runs), the model registry, and the typed
records stages hand to each other (models/train.json, reports/export.json, registry.json).
"""
