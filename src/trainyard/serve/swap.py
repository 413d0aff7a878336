"""A service that follows its registry alias: when `champion` moves, each worker swaps
models without failing or holding a request (what a user sees, the log line, the memory:
docs/serving.md, "The service follows the alias").

A ``ModelWatcher`` per worker looks every ``serve.reload_s`` seconds (jittered) through a
``follow`` callable built on the ``ModelRegistry`` the service hands in (this layer never
imports MLflow). All off the answer path, in the watcher's thread: the new version is
fetched and checked, a new predictor built and warmed up; then ``swap`` replaces the
service's predictor reference in one assignment, which a request reads once. A failed look
or fetch is logged once per distinct failure and the old model goes on answering.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Generic, TypeVar

from trainyard.core.config import ServeParams
from trainyard.core.model_ref import ModelRef
from trainyard.serve.predictor import Predictor
from trainyard.serve.settings import model_provenance, trace_headers

log = logging.getLogger("bentoml.serve.trainyard")

P = TypeVar("P")
# current version -> None (the alias has not moved) or (model file, provenance) of the
# version it points at now, downloaded and checked.
Follow = Callable[[str], tuple[Path, dict[str, str]] | None]
Headers = Sequence[tuple[bytes, bytes]]
# (new predictor, the version it replaces, the move's provenance) -> put it in place.
Swap = Callable[[Any, str, dict[str, str]], None]


def follows(source: ModelRef, reload_s: float) -> bool:
    """Whether a service serving ``source`` follows it: a registry alias, polled."""
    return source.follows and reload_s > 0


def follow_plan(source: ModelRef, reload_s: float, follow: Follow | None) -> str:
    """The start-up line's words on whether and how the service follows its source."""
    if not source.from_registry:
        return "a model file: never reloaded (serve.reload_s applies to models:/NAME@ALIAS)"
    if not source.follows:
        return f"{source} names a version: never reloaded"
    if follow is None:
        return f"{source}: no registry client here (no MLflow): never reloaded"
    if reload_s <= 0:
        return f"following {source}: off (serve.reload_s: 0)"
    return f"following {source}: a look every {reload_s:g} s (serve.reload_s), swapped live"


class TraceHeaders:
    """The trace headers of the model answering now: the request guard calls it when each
    response starts, and a swap replaces them with the predictor's."""

    def __init__(self, headers: Headers) -> None:
        self.current: list[tuple[bytes, bytes]] = list(headers)

    def __call__(self) -> list[tuple[bytes, bytes]]:
        return self.current


class ModelWatcher(Generic[P]):
    """One worker's watch on its alias: ``follow`` (the registry), ``build`` (model file +
    provenance -> a warmed-up predictor), ``swap`` (put it in place; called in the
    watcher's thread with the new predictor, the old version and the move's provenance).
    ``version``: the registry version served at start-up."""

    def __init__(
        self,
        *,
        source: str,
        version: str,
        follow: Follow,
        build: Callable[[Path, dict[str, str]], P],
        swap: Callable[[P, str, dict[str, str]], None],
        interval_s: float,
    ) -> None:
        self.source, self.version = source, str(version)
        self.follow, self.build, self.swap = follow, build, swap
        self.interval_s = interval_s
        self.swaps = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._said = ""  # the last failure logged: each is said once, not every look

    def start(self) -> ModelWatcher[P]:
        """Look every ``interval_s`` seconds in a daemon thread until ``stop``."""
        self._thread = threading.Thread(target=self._run, name="model-watcher", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def check(self) -> bool:
        """One look; on a move, fetch, build, warm up and swap. True when it swapped."""
        moved = self.follow(self.version)
        if moved is None:
            return False
        path, provenance = moved
        new_version = provenance.get("registry_version", "")
        t0 = time.monotonic()
        predictor = self.build(path, provenance)
        old = self.version
        self.swap(predictor, old, provenance)
        self.version, self.swaps = new_version, self.swaps + 1
        reason = provenance.get("reason", "")
        log.info(
            "trainyard: %s moved: v%s -> v%s (sha256 %s), swapped in after %.1f s of "
            "download and warm-up%s",
            self.source,
            old,
            new_version,
            provenance.get("onnx_sha256", "")[:12],
            time.monotonic() - t0,
            f"; reason: {reason}" if reason else "",
        )
        return True

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s * random.uniform(0.8, 1.2)):
            try:
                self.check()
                self._said = ""
            except Exception as err:  # the old model goes on answering; the next look retries
                self._say(err)

    def _say(self, err: Exception) -> None:
        text = f"{type(err).__name__}: {err}"
        if text != self._said:
            log.warning(
                "trainyard: following %s: %s; still serving v%s, looking again in %g s",
                self.source,
                text,
                self.version,
                self.interval_s,
            )
            self._said = text


def load_warm(path: Path, source: dict[str, str], params: ServeParams) -> Predictor:
    """A predictor for a version the alias moved to, verified, opened and warmed up (first
    decode and inference paid here, in the watcher's thread, not by a request)."""
    predictor = Predictor.load(path, params, model_provenance(path, source))
    predictor.warm_up()
    return predictor


def swap_into(
    service: Any,
    pages: Any,
    trace: TraceHeaders,
    carry: Callable[[Predictor, Predictor], None] | None = None,
) -> Swap:
    """The swap of a service whose api methods read ``service.predictor`` (once per
    request), whose pages answer from ``pages.predictor`` and whose guard sends ``trace``;
    ``carry(old, new)`` hands what watches the old predictor (the observer) to the new one
    before it answers."""

    def swap(predictor: Predictor, old: str, source: dict[str, str]) -> None:
        if carry is not None:
            carry(service.predictor, predictor)
        service.predictor = pages.predictor = predictor  # what the next request reads
        trace.current = trace_headers(predictor.sha256, predictor.provenance)

    return swap


def watch_if_following(
    source: ModelRef,
    params: ServeParams,
    provenance: dict[str, str],
    follow: Follow | None,
    swap: Swap,
) -> ModelWatcher[Predictor] | None:
    """A started watcher when the service follows ``source`` (``serve.reload_s``), else
    None; each new version is loaded and warmed up by ``load_warm``."""
    if follow is None or not follows(source, params.reload_s):
        return None
    return ModelWatcher(
        source=source.uri,
        version=provenance.get("registry_version", ""),
        follow=follow,
        build=lambda path, moved: load_warm(path, moved, params),
        swap=swap,
        interval_s=params.reload_s,
    ).start()
