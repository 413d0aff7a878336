"""Label Studio's REST API: the one place trainyard talks to a Label Studio server.

Plain HTTP (the standard library's urllib) rather than ``label-studio-sdk``: the SDK 2.1
pins ``opencv-python-headless``, which wants numpy < 2.3 while this venv has numpy 2.4, and
brings some twenty packages (a code generator, black, isort) for the six calls used here
(docs/label.md). Authentication is the user's API token (``Authorization: Token ...``), as
``make label-studio`` sets it up (``LABEL_STUDIO_USER_TOKEN`` with legacy tokens enabled).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any
from xml.sax.saxutils import quoteattr

from trainyard.core.errors import TrainyardError

# Where ``trainyard label`` looks, and the token it sends: the same variable the server
# reads to set its user's token (make label-studio), so one export serves both.
DEFAULT_PORT = 8089
URL_ENV, DEFAULT_URL = "TRAINYARD_LABEL_STUDIO_URL", f"http://127.0.0.1:{DEFAULT_PORT}"
TOKEN_ENV, DEFAULT_TOKEN = "LABEL_STUDIO_USER_TOKEN", "trainyard-local-review-token"
TIMEOUT_S = 60.0
PAGE = 100  # tasks per page when listing a project (their data holds the images)
# An import request's tasks: each carries its image as a data URL, and Label Studio takes
# at most DATA_UPLOAD_MAX_MEMORY_SIZE (250 MB) a request; photos are megabytes each.
IMPORT_BATCH, IMPORT_BYTES = 50, 32 << 20
# The names the labelling config gives its image and its choices: the predictions and the
# answers refer to them.
IMAGE, CHOICE = "image", "label"


class LabelStudioError(TrainyardError):
    """The server is unreachable, refused the token, or answered something unexpected."""


def label_config(classes: Sequence[str]) -> str:
    """The project's labelling config: the image and one choice per class."""
    choices = "".join(f"<Choice value={quoteattr(c)}/>" for c in classes)
    return (
        f'<View><Image name="{IMAGE}" value="${IMAGE}"/>'
        f'<Choices name="{CHOICE}" toName="{IMAGE}" choice="single" showInLine="true">'
        f"{choices}</Choices></View>"
    )


def choice_result(label: str) -> list[dict[str, Any]]:
    """An annotation's or prediction's ``result`` choosing ``label``."""
    return [
        {"from_name": CHOICE, "to_name": IMAGE, "type": "choices", "value": {"choices": [label]}}
    ]


def chosen(result: Sequence[dict[str, Any]]) -> list[str]:
    """The choices an annotation's ``result`` made (empty when it chose none)."""
    return [c for r in result if r.get("type") == "choices" for c in r["value"]["choices"]]


def _batches(tasks: Sequence[dict[str, Any]]) -> Iterator[list[dict[str, Any]]]:
    """``tasks`` in requests of at most IMPORT_BATCH tasks and about IMPORT_BYTES of JSON."""
    batch: list[dict[str, Any]] = []
    size = 0
    for task in tasks:
        n = len(json.dumps(task))
        if batch and (len(batch) >= IMPORT_BATCH or size + n > IMPORT_BYTES):
            yield batch
            batch, size = [], 0
        batch.append(task)
        size += n
    if batch:
        yield batch


@dataclass
class LabelStudio:
    """A client for one server (``url``) with one user's API ``token``."""

    url: str
    token: str
    _users: dict[int, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.url = self.url.rstrip("/")

    def call(self, method: str, path: str, body: Any = None) -> Any:
        """One request; its JSON answer. LabelStudioError names the URL on any failure."""
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            self.url + path,
            data=data,
            method=method,
            headers={"Authorization": f"Token {self.token}", "Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
                text = response.read()
        except urllib.error.HTTPError as err:
            detail = err.read()[:300].decode("utf-8", "replace")
            hint = " (check the API token)" if err.code in (401, 403) else ""
            raise LabelStudioError(
                f"Label Studio at {self.url}: {method} {path} answered {err.code}{hint}: {detail}"
            ) from None
        except (urllib.error.URLError, OSError) as err:
            reason = getattr(err, "reason", err)
            raise LabelStudioError(
                f"Label Studio at {self.url} is not reachable ({reason}); start it with "
                "`make label-studio` or pass --url"
            ) from None
        return json.loads(text) if text else None

    def project(self, title: str) -> dict[str, Any] | None:
        """The project titled ``title``, or None."""
        found = self.call("GET", f"/api/projects?title={urllib.parse.quote(title)}&page_size=1000")
        for p in found.get("results", found) if isinstance(found, dict) else found:
            if p.get("title") == title:
                return p
        return None

    def create_project(self, title: str, classes: Sequence[str], description: str) -> dict:
        body = {"title": title, "description": description, "label_config": label_config(classes)}
        return self.call("POST", "/api/projects", body)

    def tasks(self, project: int) -> Iterator[dict[str, Any]]:
        """Every task of ``project``, with its annotations and predictions."""
        seen, page = 0, 1
        while True:
            answer = self.call(
                "GET", f"/api/tasks?project={project}&fields=all&page={page}&page_size={PAGE}"
            )
            yield from answer["tasks"]
            seen += len(answer["tasks"])
            if not answer["tasks"] or seen >= answer["total"]:
                return
            page += 1

    def import_tasks(self, project: int, tasks: Sequence[dict[str, Any]]) -> int:
        """Add ``tasks`` (data and predictions) to ``project``; how many were added."""
        added = 0
        for batch in _batches(tasks):
            answer = self.call("POST", f"/api/projects/{project}/import", batch)
            added += int(answer.get("task_count", 0))
        return added

    def annotate(self, task: int, label: str) -> dict[str, Any]:
        """Answer ``task`` with ``label``, as the token's user (a scripted reviewer)."""
        return self.call("POST", f"/api/tasks/{task}/annotations", {"result": choice_result(label)})

    def user(self, user_id: int) -> str:
        """A user's email (cached): who answered a task."""
        if user_id not in self._users:
            email = self.call("GET", f"/api/users/{user_id}").get("email")
            self._users[user_id] = email or str(user_id)
        return self._users[user_id]
