"""The model card on the registry version: its description (MLflow's registry UI shows it on
the version's page), written by evaluate after the registration (track.registry)."""

from __future__ import annotations

from typing import Any

from mlflow.exceptions import MlflowException

from trainyard.core.errors import TrackingError

# MLflow's model_versions.description column is VARCHAR(5000) (PostgreSQL enforces it).
MAX_DESCRIPTION = 5000


def description_of(markdown: str, full_card: str, limit: int = MAX_DESCRIPTION) -> str:
    """The model card as a version's description: whole when it fits ``limit``, else its
    first sections that do (cut at a ``## `` heading) and a line saying where the whole card
    is (``full_card``: the command that prints it)."""
    if len(markdown) <= limit:
        return markdown
    note = f"\n\n_The card is cut here to fit the registry: `{full_card}` prints all of it._\n"
    room = limit - len(note)
    cut = markdown.rfind("\n## ", 0, room)
    return markdown[: cut if cut > 0 else room].rstrip() + note


def describe_version(client: Any, name: str, version: int | str, markdown: str) -> None:
    """Write the model card (evaluate's Markdown) as the description of ``name`` v``version``:
    the registry UI shows it on the version's page."""
    text = description_of(markdown, f"trainyard card models:/{name}/{version}")
    try:
        client.update_model_version(name, str(version), description=text)
    except MlflowException as err:
        raise TrackingError(f"describing {name} v{version}: {err.message}") from None
