"""Watching a served model: the prediction log, the model's reference, the drift score.
No torch and no matplotlib: the bento ships this package whole (the drift report's
pictures are evaluation.drift_plots)."""
