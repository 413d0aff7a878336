"""serve: what the BentoML service is made of, importable without side effects: settings, the
request guard, the endpoints' HTTP edge (api: what each takes and answers, and the reading
of a request), parsing, the predictor, the other routes (app), metrics and the worker's
lifecycle. Where it sits among the layers: docs/architecture.md.
"""
