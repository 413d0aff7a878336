"""serve: what the BentoML service is made of, importable without side effects: settings, the
request guard, request parsing, the predictor, its routes (app), metrics and the worker's
lifecycle. Imports only core and runtime; no torch, mlflow or dvc (tests/test_layers.py).
"""
