"""Watching a served model: the prediction log, the model's reference, drift."""
