"""``trainyard label push``: the images a person should look at, as Label Studio tasks.

Two sources, each task carrying the model's answer as a prediction (Label Studio shows it
preselected): (a) the audit's suspects (``suspects.csv``, ``trainyard audit``), the
suggested label as the answer; (b) served images from the prediction log (kept only with
``serve.log_images``) on which the shadow model disagreed, or whose top probability was
under ``below``, the served label as the answer. A task is keyed by its image's sha256, so a
second push adds only what is new, and a served image that is also a folder file is one task.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import mimetypes
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow.compute as pc

from trainyard.core.prediction_columns import (
    FORMAT,
    IMAGE,
    LABEL,
    MODEL_VERSION,
    PROBABILITY,
    SHADOW_LABEL,
    TIME,
)
from trainyard.data.walk import scan_folder
from trainyard.review.label_files import KEY, project_title
from trainyard.track.label_studio import LabelStudio, choice_result
from trainyard.watch.log import read_log

# Reasons of suspects.csv a reviewer answers with a class (duplicates are removed, not
# relabelled; an outlier may be either: ask with --reasons).
DEFAULT_REASONS = ("label",)
SERVED = (TIME, LABEL, PROBABILITY, SHADOW_LABEL, FORMAT, MODEL_VERSION, IMAGE)


@dataclass(frozen=True)
class PushJob:
    folder: Path
    suspects: Path  # the audit's suspects.csv
    log_dir: Path | None  # the prediction log (None: no served images)
    reasons: tuple[str, ...] = DEFAULT_REASONS
    limit: int | None = None  # suspects, most likely first (None: all)
    served: int = 100  # served images at most
    below: float = 0.6  # a served answer less sure than this is sent
    project: str | None = None  # the project's title (default: from the folder's name)


def data_url(data: bytes, name: str) -> str:
    """The image inside the task: no file serving to set up, and the bytes the reviewer
    sees are the ones pulled back."""
    kind = mimetypes.guess_type(name)[0] or "application/octet-stream"
    return f"data:{kind};base64,{base64.b64encode(data).decode()}"


def _task(data: bytes, name: str, meta: dict[str, Any], answer: str | None, score: float, by: str):
    task: dict[str, Any] = {
        "data": {"image": data_url(data, name), KEY: hashlib.sha256(data).hexdigest(), **meta}
    }
    if answer:
        task["predictions"] = [
            {"model_version": by, "score": score, "result": choice_result(answer)}
        ]
    return task


def suspect_tasks(job: PushJob, classes: Sequence[str]) -> list[dict[str, Any]]:
    """The audit's suspects of ``job.reasons``, most likely first (the CSV's order)."""
    if not job.suspects.is_file():
        raise FileNotFoundError(
            f"{job.suspects} not found: run `trainyard audit {job.folder}` first "
            "(or pass --suspects)"
        )
    with job.suspects.open(newline="") as fh:
        rows = [r for r in csv.DictReader(fh) if r["reason"] in job.reasons]
    tasks = []
    for row in rows[: job.limit]:
        path = job.folder / row["file"]
        if not path.is_file():  # moved or removed since the audit
            continue
        suggested = row.get("suggested_label") or row["given_label"]
        meta = {"file": row["file"], "given_label": row["given_label"], "source": "audit"}
        meta["why"] = f"audit: {row['reason']} (score {row['score']})"
        answer = suggested if suggested in classes else None
        tasks.append(
            _task(path.read_bytes(), path.name, meta, answer, float(row["score"]), "audit")
        )
    return tasks


def served_tasks(job: PushJob, classes: Sequence[str]) -> list[dict[str, Any]]:
    """Logged uploads the shadow disagreed on, then those least sure (``job.below``)."""
    if job.log_dir is None or job.served <= 0 or not job.log_dir.is_dir():
        return []
    table = read_log(job.log_dir)
    # Only the rows that kept their image, and only the columns read (not the embeddings).
    table = table.filter(pc.is_valid(table.column("image"))).select([c.name for c in SERVED])
    picked = []
    for row in table.to_pylist():
        shadow = row.get("shadow_label")
        disagreed = shadow is not None and shadow != row["label"]
        if disagreed or (row["probability"] or 0.0) < job.below:
            picked.append((not disagreed, row["probability"] or 0.0, row))
    picked.sort(key=lambda t: (t[0], t[1]))
    tasks, seen = [], set()
    for not_disagreed, p, row in picked:
        digest = hashlib.sha256(row["image"]).hexdigest()
        if digest in seen:
            continue
        seen.add(digest)
        why = (
            f"served: p={p:.2f}" if not_disagreed else f"served: shadow said {row['shadow_label']}"
        )
        name = f"served.{(row.get('format') or 'png').lower()}"
        meta = {"file": None, "given_label": None, "source": "served", "why": why}
        meta["served_at"] = row["time"].isoformat() if row.get("time") else None
        answer = row["label"] if row["label"] in classes else None
        tasks.append(
            _task(row["image"], name, meta, answer, p, row.get("model_version") or "served")
        )
        if len(tasks) >= job.served:
            break
    return tasks


def push(client: LabelStudio, job: PushJob) -> dict[str, Any]:
    """Create (or reuse) the folder's project and add the tasks it lacks; what was done."""
    classes = scan_folder(job.folder).classes
    title = job.project or project_title(job.folder)
    project = client.project(title)
    if project is None:
        about = f"trainyard label push of {job.folder.resolve()}"
        project = client.create_project(title, classes, about)
    have = {t["data"].get(KEY) for t in client.tasks(project["id"])}
    tasks = suspect_tasks(job, classes) + served_tasks(job, classes)
    new, keys = [], set(have)
    for task in tasks:
        key = task["data"][KEY]
        if key not in keys:
            keys.add(key)
            new.append(task)
    added = client.import_tasks(project["id"], new)
    return {
        "project": project["id"],
        "title": title,
        "url": f"{client.url}/projects/{project['id']}",
        "added": added,
        "already_there": len(tasks) - len(new),
        "suspects": sum(t["data"]["source"] == "audit" for t in tasks),
        "served": sum(t["data"]["source"] == "served" for t in tasks),
    }
