"""The MLflow run of a bulk scoring job (``trainyard predict``, the predict stage).

One run per job, in the experiment of the run that trained the model (found from the
model's ``mlflow_run_id``; the dataset's experiment when that run is not in this store):
the model's version and sha256, the source's fingerprint, the settings, the summary's
counts and speed as metrics, and the summary itself as an artifact. The table stays where
it was written (it may hold millions of rows); the run's ``predict.output`` tag says where.
"""

from __future__ import annotations

import logging
from typing import Any

from mlflow.exceptions import MlflowException

from trainyard import __version__
from trainyard.core.config import Params
from trainyard.track.lineage import git_state
from trainyard.track.outage import recording
from trainyard.track.store import ensure_experiment, resolve_tracking_uri, tracking_client

log = logging.getLogger(__name__)

KIND_TAG, KIND = "trainyard.kind", "predict"


def _experiment(client: Any, uri: str, summary: dict[str, Any], params: Params) -> str:
    """The model's experiment (its training run's), else the dataset's."""
    run_id = summary["model"].get("run_id", "")
    if run_id:
        try:
            return str(client.get_run(run_id).info.experiment_id)
        except MlflowException:
            log.info("the model's run %s is not in %s: the dataset's experiment", run_id, uri)
    return ensure_experiment(uri, params.experiment_name())


def record_predict_run(params: Params, summary: dict[str, Any], name: str) -> str:
    """Log ``summary`` (``trainyard.bulk``'s) as a new finished run; its id."""
    uri = resolve_tracking_uri()
    client = tracking_client(uri)
    model, source, speed = summary["model"], summary["source"], summary["speed"]
    with recording(uri, "the predict run"):
        run = client.create_run(
            _experiment(client, uri, summary, params),
            run_name=name,
            tags={
                KIND_TAG: KIND,
                "trainyard.version": __version__,
                "model.sha256": model["sha256"],
                "model.version": model["version"],
                "model.source": model.get("model_source", model.get("source", "")),
                "predict.output": summary["output"],
                "source.fingerprint": source["fingerprint"],
                **({"model.run_id": model["run_id"]} if model.get("run_id") else {}),
                **git_state(),
            },
        )
        run_id = run.info.run_id
        shard = summary.get("shard", {"index": 0, "count": 1})
        for key, value in {
            "source": source["where"],
            "source_kind": source["kind"],
            "source_rows": source["rows"],
            "shard": f"{shard['index']}/{shard['count']}",
            "top_k": summary["top_k"],
            "min_confidence": summary["min_confidence"],
            "batch_size": speed.get("batch_size"),
            "workers": speed.get("workers"),
            "device": speed.get("device"),
        }.items():
            client.log_param(run_id, f"predict.{key}", value)
        for key, value in _metrics(summary).items():
            client.log_metric(run_id, key, value)
        client.log_dict(run_id, summary, "predict/summary.json")
        client.set_terminated(run_id, "FINISHED")
    log.info("MLflow run %s (predict) in %s", run_id, uri)
    return run_id


def _metrics(summary: dict[str, Any]) -> dict[str, float]:
    speed = summary["speed"]
    out = {
        "predict/rows": summary["rows"],
        "predict/scored": summary["scored"],
        "predict/bad_files": summary["bad_files"],
        "predict/low_confidence": summary["low_confidence"],
        "predict/seconds": speed["seconds"],
    }
    if speed.get("img_per_s"):
        out["predict/img_per_s"] = speed["img_per_s"]
    busy = (speed.get("gpu_busy") or {}).get("mean_pct")
    if busy is not None:
        out["predict/gpu_busy_pct"] = busy
    labels = summary.get("labels") or {}
    if labels.get("accuracy") is not None:
        out["predict/accuracy"] = labels["accuracy"]
    return {k: float(v) for k, v in out.items()}
