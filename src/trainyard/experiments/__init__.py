"""Experiments at scale, above the stages: ``trainyard tune`` (Optuna), ``trainyard report``
(a change against a baseline revision) and ``trainyard exps`` (a readable ``dvc exp show``)."""
