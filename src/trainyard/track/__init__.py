"""track: the only package that imports MLflow. The store (where runs go, its check), a run's
lineage, system metrics, signals around store writes, runs carried on (runs), the training
run (train_run) and a tracking server that goes away during it (outage), a tune study's runs
(study_runs), and the model registry.

Importing any of it quiets MLflow (``quiet_mlflow``).
"""

from __future__ import annotations

import logging
import os


def quiet_mlflow() -> None:
    """MLflow's chatter off, at its source; its warnings and errors stay.

    - "🏃 View run ... at: <url>" / "🧪 View experiment at: <url>", written to stdout at
      every run's end on a tracking server: MLflow's own switch (an explicit
      ``MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT=false`` brings them back). train's last line
      names the run and the store.
    - the system-metrics monitor's INFO lines (started, stopping, terminated, "Skip logging
      GPU metrics"), four a training; its failures are warnings and still show;
    - "Creating initial MLflow database tables..." / "Updating database tables" on a new
      sqlite store.
    """
    os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
    for name in ("mlflow.system_metrics", "mlflow.store.db.utils"):
        logging.getLogger(name).setLevel(logging.WARNING)


quiet_mlflow()  # at import: whoever uses MLflow through trainyard imports this package
