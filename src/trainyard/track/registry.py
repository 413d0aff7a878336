"""MLflow model logging and registry: the ONNX model as an MLflow model, versions, aliases.

Who gets `champion` (the margin, a sweep's challengers) and how teammates deciding at once
take turns with nothing but the MLflow server (a version registered ``decision=pending``,
waiting for every lower pending one, ``decision`` written after the alias; one pending
over ``STALE_AFTER_S`` abandoned) are docs/tracking.md's "Model registry"; what an
interrupted registration leaves, docs/faults.md. Why the turns hold: the server numbers a
model's versions in one transaction each (max + 1, under the registered model's row lock
on PostgreSQL, the database write lock on sqlite; a clash retries), so once version N
exists every lower one is visible with its tags.

A registration (``register_and_promote``) is complete once its alias points at it; if
anything fails or is interrupted before that, the version is deleted again (a version
without its alias would look like a decision never made), and a rerun first deletes
versions of its run cut off before their decision (SIGKILL, a Ctrl-C inside MLflow's own
register call).
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import random
import time
from typing import Any

import mlflow
import mlflow.onnx
import numpy as np
from mlflow.exceptions import MlflowException
from mlflow.models import infer_signature

from trainyard.core.errors import TrackingError
from trainyard.core.pause_points import pause_point
from trainyard.runtime.sessions import load_onnx
from trainyard.track.interrupts import release_interrupted_store, signals_deferred
from trainyard.track.versions import (
    ACCURACY_TAG,
    CHALLENGER,
    CHAMPION,
    DATA_TAG,
    DECISION_TAG,
    PENDING,
    REFERENCE_TAG,
    SHA_TAG,
    current_alias,
)

log = logging.getLogger(__name__)

# A registration waits only for lower pending versions, each of which waits only for lower
# ones and then decides in milliseconds: a version pending this long was killed.
STALE_AFTER_S = 600.0
POLL_S = 0.2  # between looks at the lower pending versions (jittered)


def _register_quietly(model_uri: str, name: str, tags: dict[str, str]) -> Any:
    """``mlflow.register_model``, whose "Successfully registered model ..." / "Created
    version ..." lines go to stderr with no switch: the stage's own line says it once."""
    with contextlib.redirect_stderr(io.StringIO()):
        return mlflow.register_model(model_uri, name, tags=tags)


def log_onnx_model(onnx_path: str | os.PathLike[str], example: np.ndarray) -> str:
    """Log ``onnx_path`` to the active run as an MLflow ONNX model; return its model URI.

    The file is stored as is (no external data): its sha256 stays the one export recorded,
    so a registry download can be checked against it.
    """

    # Here, not at the top (tests/house DEFERRED): onnx brings ml_dtypes, 0.6-0.7 s of
    # import that evaluate and promote, the registry's other users, never need.
    import onnx

    # The parity check just opened this file and said where it runs: quietly, this time.
    logits = load_onnx(onnx_path, device="cpu", say=False).run(example)
    info = mlflow.onnx.log_model(
        onnx.load(str(onnx_path)),
        name="model",
        signature=infer_signature(example, logits),  # batch dim inferred as variable (-1)
        input_example=example,
        save_as_external_data=False,
        onnx_execution_providers=["CPUExecutionProvider"],
        # Named, not inferred: MLflow's inference loads the model again in a subprocess
        # (3 s of every export) to list what it imports, which is always these.
        pip_requirements=[*mlflow.onnx.get_default_pip_requirements(), f"numpy=={np.__version__}"],
    )
    return info.model_uri


def decide(
    test_acc: float, champion: Any | None, margin: float, sweep: str | None = None
) -> tuple[str, str]:
    """(alias, reason) for a new version with ``test_acc`` against the current champion;
    ``sweep``: the DVC experiment's name when it ran in a queue or ``--temp`` copy."""
    if sweep:
        against = "no champion yet" if champion is None else f"champion v{champion.version}"
        return CHALLENGER, (
            f"DVC experiment {sweep} ran in a sweep (queue or --temp): test accuracy "
            f"{test_acc:.4f}, registered as challenger; a sweep never moves champion "
            f"({against}). Promote the one you choose: trainyard promote NAME --version N, "
            "after it ran as the service's shadow (or alias it champion in the MLflow UI)"
        )
    if champion is None:
        return CHAMPION, "first version with a test accuracy: becomes champion"
    try:
        champ_acc = float(champion.tags[ACCURACY_TAG])
    except (KeyError, ValueError):
        return CHAMPION, (
            f"champion v{champion.version} has no {ACCURACY_TAG} tag to beat: replaced"
        )
    # The tag holds 6 decimals: compare at that precision, or a rerun with the very same
    # accuracy (0.225806... against the tag's 0.225806) would "beat" its own champion.
    if round(test_acc, 6) > round(champ_acc + margin, 6):
        return CHAMPION, (
            f"test accuracy {test_acc:.4f} beats champion v{champion.version} "
            f"({champ_acc:.4f}) by more than the margin {margin:g}"
        )
    return CHALLENGER, (
        f"test accuracy {test_acc:.4f} does not beat champion "
        f"v{champion.version} ({champ_acc:.4f}) by more than the margin "
        f"{margin:g}: champion stays"
    )


def register_and_promote(
    client: Any,
    name: str,
    model_uri: str,
    run_id: str,
    test_acc: float,
    data_version: str,
    onnx_sha256: str,
    margin: float,
    contract: Any | None = None,
    sweep: str | None = None,
    stale_after_s: float = STALE_AFTER_S,
    extra_tags: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Register a new version, wait for its turn, then move `champion` or `challenger` to it
    (only `challenger` for a ``sweep``: the DVC experiment's name, tagged on the version;
    a sweep does not wait).

    ``contract`` (the ONNX model's dataset card) puts the input contract on the version:
    source, class count and names, input shape and resize policy, so the registry UI shows
    what a version takes and answers without downloading it. The turn: the module's
    docstring; ``stale_after_s``: how long a lower version may stay pending before it is
    taken for abandoned. ``extra_tags``: more tags in the creating write (the int8 file's).
    What a failed, interrupted or repeated registration leaves: the module's docstring.
    """
    tags = version_tags(run_id, test_acc, data_version, onnx_sha256, contract, sweep, extra_tags)
    done = _already_registered(client, name, run_id, tags, extra_tags)
    if done is not None:
        return done
    _remove_cut_off(client, name, run_id)
    if not sweep:  # the ticket: in the version's own creating write, never seen without it
        tags[DECISION_TAG] = PENDING
    version = None
    try:
        # A Ctrl-C or SIGTERM waits for each group of writes (milliseconds) and then stops
        # the stage; the wait between them is interruptible, and undone like the rest.
        with signals_deferred():
            version = _register_quietly(model_uri, name, tags)
        alias, reason, previous = _decide_in_turn(
            client, name, version, test_acc, margin, sweep, stale_after_s
        )
    except BaseException as err:
        # BaseException: a Ctrl-C (KeyboardInterrupt) cuts a registration off as surely as a
        # store error does, and must not leave a version without its alias either.
        if not isinstance(err, Exception):
            release_interrupted_store(err)
        _undo(client, name, run_id, version)
        if not isinstance(err, Exception):
            raise
        what = f"v{version.version}" if version is not None else "a new version"
        raise TrackingError(f"registering {name} {what} failed: {err}") from err
    return _record(name, version.version, alias, reason, previous, model_uri, False)


def _decide_in_turn(
    client: Any,
    name: str,
    version: Any,
    test_acc: float,
    margin: float,
    sweep: str | None,
    stale_after_s: float,
) -> tuple[str, str, int | None]:
    """Wait for the turn (not a sweep's), decide against the champion the versions below
    left, and write the decision: (alias, reason, the champion it replaced)."""
    abandoned = [] if sweep else _wait_for_turn(client, name, version, stale_after_s)
    champion = current_alias(client, name, CHAMPION)
    alias, reason = decide(test_acc, champion, margin, sweep)
    if abandoned:
        listed = ", ".join(f"v{v}" for v in abandoned)
        reason += f" (not waited for: {listed}, pending over {stale_after_s:g} s, abandoned)"
    previous = int(champion.version) if champion is not None else None
    with signals_deferred():
        client.set_model_version_tag(name, version.version, "decision_reason", reason)
        client.set_model_version_tag(
            name, version.version, "previous_champion", str(previous or "")
        )
        move_alias(client, name, alias, version.version)
        client.set_model_version_tag(name, version.version, DECISION_TAG, alias)
    return alias, reason, previous


def _record(
    name: str,
    version: Any,
    alias: str,
    reason: str,
    previous: int | None,
    source: str,
    already: bool,
) -> dict[str, Any]:
    """register_and_promote's answer (core.handoffs.Registration's fields)."""
    return {
        "model_name": name,
        "version": int(version),
        "alias": alias,
        "reason": reason,
        "previous_champion": previous,
        "model_uri": f"models:/{name}@{alias}",
        "source": source,
        "already_registered": already,
    }


def _wait_for_turn(client: Any, name: str, mine: Any, stale_after_s: float) -> list[int]:
    """Return once no version of ``name`` below ``mine`` is pending: the ones below have
    decided and moved their aliases. Returns the versions given up on as abandoned."""
    # The server's clock, not ours: a teammate's machine may be minutes off.
    server_start, start = mine.creation_timestamp / 1000, time.monotonic()
    abandoned: list[int] = []
    said = False
    while True:
        # Filter on the tag (a model name may hold quotes the filter cannot escape).
        found = client.search_model_versions(f"tags.{DECISION_TAG} = '{PENDING}'")
        below = [
            v
            for v in found
            if v.name == name
            and int(v.version) < int(mine.version)
            and int(v.version) not in abandoned
        ]
        if not below:
            return abandoned
        aliases = client.get_registered_model(name).aliases
        now = server_start + time.monotonic() - start
        waiting = False
        for v in below:
            held = _held_alias(aliases, v.version)
            if held is not None:  # it decided and was killed before its decision tag
                _finish(client, name, v.version, held)
            elif now - v.creation_timestamp / 1000 > stale_after_s:
                log.warning(
                    "%s v%s has been pending for over %g s: taken for an abandoned "
                    "registration (killed before its decision), not waited for",
                    name,
                    v.version,
                    stale_after_s,
                )
                abandoned.append(int(v.version))
            else:
                waiting = True
        if waiting:
            if not said:  # once: a teammate's registration may be waiting on its own turn
                listed = ", ".join(f"v{v.version}" for v in below)
                log.info("%s v%s waits for %s to decide first", name, mine.version, listed)
                said = True
            pause_point("registry.waiting")
            time.sleep(POLL_S * random.uniform(0.5, 1.5))  # jitter: waiters do not march


def version_tags(
    run_id: str,
    test_acc: float,
    data_version: str,
    onnx_sha256: str,
    contract: Any | None = None,
    sweep: str | None = None,
    extra: dict[str, str] | None = None,
) -> dict[str, str]:
    """The tags a new version is registered with: what it scored on which data, its bytes,
    its run, the input contract, the DVC experiment of a sweep, and ``extra`` (its int8
    file's, track.quantized)."""
    tags = {
        ACCURACY_TAG: f"{test_acc:.6f}",
        DATA_TAG: data_version,
        SHA_TAG: onnx_sha256,
        "run_id": run_id,
    }
    if contract is not None:
        classes = json.dumps(list(contract.classes), ensure_ascii=False)
        tags |= {
            "dataset.source": contract.source,
            "dataset.num_classes": str(contract.num_classes),
            # MLflow caps a tag value at 5,000 characters; hundreds of long names exceed it.
            "dataset.classes": classes if len(classes) <= 5000 else classes[:4990] + "...",
            "input_shape": "x".join(str(d) for d in contract.input_shape),
            "resize": contract.resize,
        }
    if sweep:
        tags["dvc.exp_name"] = sweep
    return tags | (extra or {})


def _versions_of_run(client: Any, name: str, run_id: str) -> list[Any]:
    """Versions of ``name`` that register_and_promote made for ``run_id`` (its run_id tag)."""
    # Filter on the run id only (hex): a model name may hold quotes the filter cannot escape.
    found = client.search_model_versions(f"tags.run_id = '{run_id}'")
    return [v for v in found if v.name == name]


def move_alias(client: Any, name: str, alias: str, version: Any) -> None:
    """Point ``alias`` at ``version``. Two first writes of one alias at once (a sweep's
    `challenger`, which takes no turn, and another's) clash in the server's insert (an
    IntegrityError, seen with four registrations at once); written again, it is a move."""
    pause_point("registry.moving_alias")
    for attempt in range(3):
        try:
            client.set_registered_model_alias(name, alias, version)
            return
        except MlflowException:
            if attempt == 2:
                raise
            time.sleep(0.2 * (attempt + 1))


def _held_alias(aliases: dict[str, Any], version: Any) -> str | None:
    """The decision alias (champion or challenger) that points at ``version``, if one does."""
    for alias in (CHAMPION, CHALLENGER):
        if str(aliases.get(alias)) == str(version):
            return alias
    return None


def _finish(client: Any, name: str, version: Any, alias: str) -> None:
    """Write the decision tag of a version that holds ``alias`` but was cut off before it."""
    client.set_model_version_tag(name, version, DECISION_TAG, alias)
    log.info("%s v%s holds %s, its decision tag was cut off: written", name, version, alias)


def _already_registered(
    client: Any, name: str, run_id: str, tags: dict[str, str], refresh: dict[str, str] | None
) -> dict[str, Any] | None:
    """The record of a complete registration of this very model that still stands, if any;
    ``refresh`` is written onto it (the same model exported again with its int8 file)."""
    same = (ACCURACY_TAG, DATA_TAG, SHA_TAG)
    candidates = [
        v
        for v in _versions_of_run(client, name, run_id)
        if all(v.tags.get(k) == tags[k] for k in same)
    ]
    if not candidates:
        return None
    aliases = client.get_registered_model(name).aliases  # {alias: version}
    for v in sorted(candidates, key=lambda v: -int(v.version)):
        decision = v.tags.get(DECISION_TAG)
        alias = decision if decision in (CHAMPION, CHALLENGER) else _held_alias(aliases, v.version)
        if alias is None or str(aliases.get(alias)) != str(v.version):
            continue
        if decision != alias:  # cut off between its alias and its decision tag
            _finish(client, name, v.version, alias)
        for key, value in (refresh or {}).items():
            client.set_model_version_tag(name, v.version, key, value)
        previous = v.tags.get("previous_champion", "")
        number = int(previous) if previous.isdigit() else None
        reason = v.tags.get("decision_reason", "")
        return _record(name, v.version, alias, reason, number, v.source, True)
    return None


def _remove_cut_off(client: Any, name: str, run_id: str) -> None:
    """Delete this run's versions that never got a decision: registrations cut off by a kill.

    MLflow creates the version with our tags (run_id, onnx_sha256, decision pending) in one
    write; the decision's tags follow, then the alias, then the final decision. So a version
    with our tags, still pending (or a sweep's, with no decision) and holding no alias was
    never promoted and nothing points at it; one holding its alias had decided, and gets its
    decision tag. One registered by hand from this run (in the UI) has no onnx_sha256 tag
    and is left alone.
    """
    undecided = [
        v
        for v in _versions_of_run(client, name, run_id)
        if v.tags.get(SHA_TAG) and v.tags.get(DECISION_TAG) not in (CHAMPION, CHALLENGER)
    ]
    if not undecided:
        return
    aliases = client.get_registered_model(name).aliases
    for v in undecided:
        held = _held_alias(aliases, v.version)
        if held is not None:
            _finish(client, name, v.version, held)
            continue
        client.delete_model_version(name, v.version)
        log.info(
            "deleted %s v%s: its registration was cut off before the decision",
            name,
            v.version,
        )


def _undo(client: Any, name: str, run_id: str, version: Any | None) -> None:
    """After a failed or interrupted registration: remove what it left; never raises."""
    try:
        if version is None:
            # Cut off inside MLflow's register call, which may have created the version.
            _remove_cut_off(client, name, run_id)
            return
        held = _held_alias(client.get_registered_model(name).aliases, version.version)
        if held is None:  # cut off before its alias moved: a version nothing points at
            client.delete_model_version(name, version.version)
        else:  # the alias moved before the interruption: the registration is complete
            _finish(client, name, version.version, held)
    except Exception:  # the store is already failing; report the first error
        log.exception("could not remove a half-registered version of %s", name)


def tag_reference(client: Any, name: str, version: int | str, reference_sha256: str) -> None:
    """Tag a version with its drift reference's sha256, which ``fetch_reference`` checks."""
    try:
        client.set_model_version_tag(name, str(version), REFERENCE_TAG, reference_sha256)
    except MlflowException as err:
        raise TrackingError(f"tagging {name} v{version}'s reference: {err.message}") from None
