"""serve: what the BentoML service is made of, importable without side effects: settings, the
request guard, request parsing, the classifier logic and metrics. No torch, mlflow or dvc.
"""
