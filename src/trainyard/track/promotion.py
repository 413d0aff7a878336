"""Moving `champion` by hand: promote a version (after its shadow run), roll back to the one
before.

Evaluate decides `champion` / `challenger` when it registers a version (track.registry);
a person moves `champion` afterwards with ``trainyard promote``. What each move records
(``promote.*`` and ``shadow.*`` version tags), which version a rollback returns to, and
the exit codes: docs/serving.md, "Promote and roll back". MLflow sets an alias
last-writer-wins, with no compare-and-set: after moving it, the move reads the alias back
and reports another move that landed at the same moment, rather than claiming a move that
did not stand.
"""

from __future__ import annotations

import getpass
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import mlflow
from mlflow.exceptions import MlflowException

from trainyard.core.errors import PromotionRefused, TrackingError
from trainyard.core.model_ref import ModelRef, registered_alias
from trainyard.track.interrupts import signals_deferred
from trainyard.track.registry import move_alias
from trainyard.track.store import check_tracking_uri, resolve_tracking_uri
from trainyard.track.versions import (
    ACCURACY_TAG,
    CHAMPION,
    DATA_TAG,
    DECISION_TAG,
    PROMOTE_REASON_TAG,
    SHA_TAG,
    current_alias,
)

ACTION_TAG, TIME_TAG, USER_TAG = "promote.action", "promote.time", "promote.user"
PREVIOUS_TAG, FORCED_TAG, FROM_TAG = (
    "promote.previous_champion",
    "promote.forced",
    "promote.from",
)
SHADOW_PREFIX = "shadow."
# The shadow's figures (watch.agreement.shadow_figures) kept as tags, and their format.
SHADOW_TAGS = {
    "rows": "{:d}",
    "agreement": "{:.4f}",
    "shadow_p50_ms": "{:.2f}",
    "shadow_p99_ms": "{:.2f}",
    "answer_p50_ms": "{:.2f}",
    "answer_p99_ms": "{:.2f}",
    "first": "{}",
    "last": "{}",
}


def registry_client() -> tuple[Any, str]:
    """(MLflow client, tracking URI) of the store stages use, checked to answer first."""
    uri = resolve_tracking_uri()
    check_tracking_uri(uri)
    return mlflow.MlflowClient(tracking_uri=uri), uri


def find_version(client: Any, ref: ModelRef) -> Any:
    """The version ``models:/NAME/N`` names, or the one ``models:/NAME@ALIAS`` points at;
    an unknown model, version or alias is a PromotionRefused naming it and what exists
    instead."""
    name, version, alias = ref.name, ref.version, ref.alias
    try:
        model = client.get_registered_model(name)
    except MlflowException as err:
        if err.error_code != "RESOURCE_DOES_NOT_EXIST":
            raise TrackingError(f"registered model {name!r}: {err.message}") from None
        known = sorted(m.name for m in client.search_registered_models(max_results=50))
        raise PromotionRefused(
            f"no registered model {name!r} in the registry; its models: "
            f"{', '.join(known) or 'none'}"
        ) from None
    if alias is not None:
        if alias not in model.aliases:
            held = ", ".join(f"{a} -> v{v}" for a, v in sorted(model.aliases.items()))
            raise PromotionRefused(f"{name} has no alias {alias!r}; its aliases: {held or 'none'}")
        version = str(model.aliases[alias])
    try:
        return client.get_model_version(name, str(version))
    except MlflowException:
        versions = sorted(int(v.version) for v in client.search_model_versions(f"name = '{name}'"))
        listed = ", ".join(str(v) for v in versions[-20:]) or "none"
        raise PromotionRefused(f"{name} has no version {version}; its versions: {listed}") from None


def previous_champion(mv: Any) -> str | None:
    """The version that ``mv`` (the champion) replaced, as recorded, or None."""
    moved = mv.tags.get(PREVIOUS_TAG)
    if moved is not None:  # a promote or rollback put it there: the latest move
        return moved or None
    if mv.tags.get(DECISION_TAG) == CHAMPION:  # evaluate's decision did
        return mv.tags.get("previous_champion") or None
    return None


def promote(
    client: Any,
    target: Any,
    *,
    reason: str,
    figures: dict[str, Any] | None,
    forced: bool,
    from_alias: str | None = None,
) -> dict[str, Any]:
    """Move `champion` to ``target`` (a model version), recording why, when, who, the
    champion it replaced, whether it was ``forced`` and the shadow's ``figures``."""
    name = target.name
    if not target.tags.get(SHA_TAG):
        raise PromotionRefused(
            f"{name} v{target.version} has no {SHA_TAG} tag: a service refuses a model whose "
            "bytes cannot be checked, so it cannot be champion (register it through the "
            "evaluate stage)"
        )
    champion = current_alias(client, name, CHAMPION)
    if champion is not None and str(champion.version) == str(target.version):
        raise PromotionRefused(f"{name} v{target.version} is already champion: nothing to do")
    tags = {FORCED_TAG: "true" if forced else "false", FROM_TAG: from_alias or ""}
    for key, fmt in SHADOW_TAGS.items():
        value = (figures or {}).get(key)
        if value is not None:
            tags[SHADOW_PREFIX + key] = fmt.format(value)
    if figures and figures.get("against"):
        tags[SHADOW_PREFIX + "against"] = ", ".join(figures["against"])[:5000]
    # Figures of an earlier promote of this version would read as this one's.
    stale = [k for k in target.tags if k.startswith(SHADOW_PREFIX) and k not in tags]
    return _move(client, target, champion, "promote", reason, tags, stale)


def rollback(client: Any, name: str, *, reason: str) -> dict[str, Any]:
    """Move `champion` back to the version the current champion replaced."""
    champion = current_alias(client, name, CHAMPION)
    if champion is None:
        find_version(client, registered_alias(name, CHAMPION, "NAME"))  # an unknown model
    previous = previous_champion(champion)
    if previous is None:
        raise PromotionRefused(
            f"nothing to roll back to: {name} v{champion.version} is champion with no "
            "previous champion recorded (the first champion, or an alias set by hand); "
            f"choose one: trainyard promote {name} --version N"
        )
    try:
        target = client.get_model_version(name, previous)
    except MlflowException:
        raise PromotionRefused(
            f"cannot roll back {name} to v{previous}, the champion before "
            f"v{champion.version}: that version no longer exists; choose one: "
            f"trainyard promote {name} --version N"
        ) from None
    return _move(client, target, champion, "rollback", reason, {FORCED_TAG: "false"})


def _move(
    client: Any,
    target: Any,
    champion: Any | None,
    action: str,
    reason: str,
    tags: dict[str, str],
    stale: Sequence[str] = (),
) -> dict[str, Any]:
    """Record the move on ``target`` (``stale`` tags deleted), point `champion` at it, and
    check that it stands."""
    name, version = target.name, str(target.version)
    previous = str(champion.version) if champion is not None else ""
    tags = {
        ACTION_TAG: action,
        PROMOTE_REASON_TAG: reason,
        TIME_TAG: datetime.now(UTC).isoformat(timespec="seconds"),
        USER_TAG: _user(),
        PREVIOUS_TAG: previous,
        **tags,
    }
    with signals_deferred():  # the tags and the alias together, or a Ctrl-C waits for them
        for key in stale:
            client.delete_model_version_tag(name, version, key)
        for key, value in tags.items():
            client.set_model_version_tag(name, version, key, value)
        move_alias(client, name, CHAMPION, version)
    now = current_alias(client, name, CHAMPION)
    if now is None or str(now.version) != version:
        raise TrackingError(
            f"{name}: champion was moved to v{version}, but another move landed at the same "
            f"moment and it now points at "
            f"{'nothing' if now is None else 'v' + str(now.version)}; check with your team "
            "and run the command again if needed"
        )
    return {
        "model_name": name,
        "version": int(version),
        "previous_champion": int(previous) if previous else None,
        "action": action,
        "reason": reason,
        "tags": tags,
        "accuracy": compared_accuracy(target, champion),
    }


def compared_accuracy(target: Any, champion: Any | None) -> str:
    """The new champion's test accuracy against the one it replaces, in words ("" when the
    target has none). A shadow's agreement says how often the two differ, not which is
    right; the test split says that, when both versions were scored on the same data."""
    new = target.tags.get(ACCURACY_TAG)
    if new is None:
        return ""
    words = f"test accuracy {float(new):.4f}"
    old = champion.tags.get(ACCURACY_TAG) if champion is not None else None
    if old is None:
        return words
    words += f" against v{champion.version}'s {float(old):.4f}"
    if target.tags.get(DATA_TAG) != champion.tags.get(DATA_TAG):
        return f"{words} (different data versions: not the same test split)"
    points = round((float(new) - float(old)) * 100, 2)
    if points == 0:
        return f"{words}: the same"
    return f"{words}: {abs(points):.2f} points {'higher' if points > 0 else 'LOWER'}"


def _user() -> str:
    try:
        return getpass.getuser()
    except (OSError, KeyError):  # a container's uid with no passwd entry and no $USER
        return "unknown"
