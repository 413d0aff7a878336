"""``trainyard label pull``: the reviewed labels back into the folder, nothing lost.

A file whose reviewed label differs from its folder moves to that class's folder (same
split); a served image the reviewer labelled is added (``train/`` of a split tree); each
review (a change or a confirmation) is a line of ``.trainyard/labels.jsonl``: who, when,
which task, the label before and after, and why it was sent.

Every answer is checked before anything is written (an answer that is not one of the
folder's classes refuses the whole pull, naming the task). Then the plan is written as a
journal, whole and renamed into place, and only then applied, one rename at a time; the
manifest is appended last and the journal removed. A pull killed anywhere leaves either
the folder as it was (no journal yet) or a journal that the next ``label pull`` finishes
first: a file is always in its old place or its new one, never in neither.
"""

from __future__ import annotations

import base64
import json
import mimetypes
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from trainyard.core.errors import TrainyardError
from trainyard.core.io import atomic_write_bytes, atomic_write_json
from trainyard.core.pause_points import pause_point
from trainyard.data.walk import scan_folder
from trainyard.review.label_files import (
    INCOMING,
    JOURNAL,
    KEY,
    append_manifest,
    free_name,
    label_of,
    project_title,
    read_manifest,
    refiled,
)
from trainyard.track.label_studio import LabelStudio, chosen


class AnswerError(TrainyardError):
    """A reviewed answer trainyard cannot apply (not one of the folder's classes)."""


@dataclass(frozen=True)
class PullJob:
    folder: Path
    project: str | None = None  # the project's title (default: from the folder's name)


@dataclass
class Plan:
    ops: list[dict[str, str]] = field(default_factory=list)  # renames: from -> to
    records: list[dict[str, Any]] = field(default_factory=list)  # the manifest's new lines
    incoming: dict[str, bytes] = field(default_factory=dict)  # served images to add
    errors: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)  # files gone since the push


def latest_answer(task: dict[str, Any]) -> dict[str, Any] | None:
    """The task's latest annotation that chose something (a skipped task has none)."""
    done = [a for a in task.get("annotations", []) if not a.get("was_cancelled")]
    done = [a for a in done if chosen(a.get("result", []))]
    return max(done, key=lambda a: a.get("updated_at") or "", default=None)


def _reviewer(client: LabelStudio, annotation: dict[str, Any]) -> str:
    who = annotation.get("completed_by")
    if isinstance(who, dict):
        return who.get("email") or str(who.get("id"))
    return client.user(int(who)) if who is not None else "unknown"


def _served_bytes(url: str) -> tuple[bytes, str]:
    """A data URL's bytes and the extension of its media type."""
    head, _, payload = url.partition(",")
    kind = head.removeprefix("data:").split(";")[0]
    return base64.b64decode(payload), mimetypes.guess_extension(kind) or ".img"


def plan_pull(
    client: LabelStudio, folder: Path, project: dict[str, Any], tasks: Sequence[dict]
) -> Plan:
    """What the reviewed answers change, checked, and nothing written."""
    scan = scan_folder(folder)
    classes, plan = scan.classes, Plan()
    done = {r["review"] for r in read_manifest(folder)}
    taken: set[str] = set()
    now = datetime.now(UTC).isoformat(timespec="seconds")
    for task in tasks:
        answer = latest_answer(task)
        if answer is None or KEY not in task["data"]:
            continue
        review = f"{project['id']}/{task['id']}/{answer['id']}@{answer.get('updated_at')}"
        if review in done:
            continue
        label = chosen(answer["result"])[0]
        if label not in classes:
            plan.errors.append(
                f"task {task['id']}: the answer {label!r} is not one of the folder's classes "
                f"({', '.join(classes)})"
            )
            continue
        data = task["data"]
        record = {
            "review": review,
            "project": project["id"],
            "task": task["id"],
            "annotation": answer["id"],
            "reviewer": _reviewer(client, answer),
            "reviewed_at": answer.get("updated_at"),
            "pulled_at": now,
            "why": data.get("why"),
            "sha256": data[KEY],
            "old_label": data.get("given_label"),
            "new_label": label,
            "file": data.get("file"),
        }
        if data.get("file"):
            _plan_file(folder, plan, record, taken)
        else:
            _plan_served(folder, scan.layout, plan, record, data["image"], taken)
    return plan


def _plan_file(folder: Path, plan: Plan, record: dict[str, Any], taken: set[str]) -> None:
    rel = record["file"]
    record["old_label"] = label_of(rel)
    if record["new_label"] == record["old_label"]:
        plan.records.append({**record, "action": "kept", "to": rel})
        return
    if not (folder / rel).is_file():
        plan.missing.append(rel)
        return
    to = free_name(folder, refiled(rel, record["new_label"]), taken, f"t{record['task']}")
    taken.add(to)
    plan.ops.append({"from": rel, "to": to})
    plan.records.append({**record, "action": "moved", "to": to})


def _plan_served(
    folder: Path, layout: str, plan: Plan, record: dict, url: str, taken: set[str]
) -> None:
    data, ext = _served_bytes(url)
    top = "train/" if layout == "splits" else ""
    to = f"{top}{record['new_label']}/served-{record['sha256'][:16]}{ext}"
    if (folder / to).exists() or to in taken:  # added by an earlier pull
        return
    taken.add(to)
    staged = f"{INCOMING}/{record['sha256']}{ext}"
    plan.incoming[staged] = data
    plan.ops.append({"from": staged, "to": to})
    plan.records.append({**record, "action": "added", "to": to})


def apply_journal(folder: Path) -> int:
    """Finish the journal in ``folder`` (a rename already done is passed over); how many
    files it moved or added. Then the manifest, then the journal is removed."""
    path = folder / JOURNAL
    journal = json.loads(path.read_text())
    for op in journal["ops"]:
        pause_point("label.pull.apply")
        src, dst = folder / op["from"], folder / op["to"]
        if src.exists():
            if dst.exists():
                raise TrainyardError(f"{path}: {op['to']} exists; {op['from']} left where it is")
            dst.parent.mkdir(parents=True, exist_ok=True)
            os.replace(src, dst)
        elif not dst.exists():
            raise TrainyardError(f"{path}: neither {op['from']} nor {op['to']} exists")
    pause_point("label.pull.manifest")
    append_manifest(folder, journal["records"])
    path.unlink()
    return len(journal["ops"])


def pull(client: LabelStudio, job: PullJob) -> dict[str, Any]:
    """Finish a journal left behind, then plan, journal and apply the new answers."""
    folder = job.folder
    finished = apply_journal(folder) if (folder / JOURNAL).exists() else None
    title = job.project or project_title(folder)
    project = client.project(title)
    if project is None:
        raise TrainyardError(
            f"Label Studio at {client.url} has no project {title!r}: run `trainyard label "
            f"push {folder}` first (or pass --project)"
        )
    plan = plan_pull(client, folder, project, list(client.tasks(project["id"])))
    if plan.errors:
        raise AnswerError("; ".join(plan.errors) + "; nothing was changed")
    for staged, data in plan.incoming.items():
        atomic_write_bytes(folder / staged, data)
    if plan.records:
        atomic_write_json(folder / JOURNAL, {"ops": plan.ops, "records": plan.records})
        pause_point("label.pull.journal")
        apply_journal(folder)
    actions = [r["action"] for r in plan.records]
    return {
        "project": project["id"],
        "moved": actions.count("moved"),
        "added": actions.count("added"),
        "kept": actions.count("kept"),
        "missing": plan.missing,
        "finished_journal": finished,
    }
