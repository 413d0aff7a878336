"""The watcher that swaps a followed model, in process (the real `bentoml serve` under load
is tests/track/test_promote.py's slow test): what it does on a move, on a failure, and what the
start-up line says for each kind of model source."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from starlette.testclient import TestClient
from test_serve_unit import echo

from trainyard.core.model_ref import parse_model_ref
from trainyard.serve.guard import RequestGuard
from trainyard.serve.swap import ModelWatcher, TraceHeaders, follow_plan, follows

SOURCE = "models:/clf@champion"


class Registry:
    """The alias as the registry holds it: the version it points at, and a fetch that may
    fail (a download cut off, a sha256 that does not match)."""

    def __init__(self) -> None:
        self.version, self.fail, self.looks = "1", "", 0

    def follow(self, current: str) -> tuple[Path, dict[str, str]] | None:
        self.looks += 1
        if self.version == current:
            return None
        if self.fail:
            raise RuntimeError(self.fail)
        return Path(f"v{self.version}.onnx"), {"registry_version": self.version, "reason": "r"}


def watcher(registry: Registry, served: list, interval_s: float = 60) -> ModelWatcher:
    return ModelWatcher(
        source=SOURCE,
        version="1",
        follow=registry.follow,
        build=lambda path, provenance: f"predictor of {path.name}",
        swap=lambda predictor, old, provenance: served.append((old, predictor)),
        interval_s=interval_s,
    )


def test_a_move_is_built_then_swapped_once_and_logged(caplog):
    registry, served = Registry(), []
    watch = watcher(registry, served)
    assert watch.check() is False and served == []
    registry.version = "2"
    with caplog.at_level(logging.INFO, logger="bentoml.serve.trainyard"):
        assert watch.check() is True
    assert served == [("1", "predictor of v2.onnx")]
    assert watch.check() is False  # the new version is the one served now: no second swap
    assert watch.version == "2" and watch.swaps == 1
    assert f"{SOURCE} moved: v1 -> v2" in caplog.text and "reason: r" in caplog.text


def test_a_failed_fetch_keeps_the_old_model_says_it_once_and_retries(caplog):
    registry, served = Registry(), []
    registry.version, registry.fail = "2", "sha256 does not match"
    watch = watcher(registry, served, interval_s=0.02)
    with caplog.at_level(logging.WARNING, logger="bentoml.serve.trainyard"):
        watch.start()
        try:
            while registry.looks < 5:
                threading.Event().wait(0.02)
            assert served == [] and watch.version == "1"
            registry.fail = ""  # the next look succeeds
            while not served:
                threading.Event().wait(0.02)
        finally:
            watch.stop()
    assert served == [("1", "predictor of v2.onnx")]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "still serving v1" in warnings[0].getMessage()


def test_only_a_registry_alias_is_followed_and_the_start_up_line_says_which():
    alias, version, path = (
        parse_model_ref(s, "serve.model") for s in (SOURCE, "models:/clf/3", "models/model.onnx")
    )
    assert follows(alias, 10) and not follows(alias, 0)
    assert not follows(version, 10) and not follows(path, 10)
    follow = Registry().follow
    assert "a look every 10 s" in follow_plan(alias, 10, follow)
    assert "off (serve.reload_s: 0)" in follow_plan(alias, 0, follow)
    assert "names a version: never reloaded" in follow_plan(version, 10, follow)
    assert "a model file: never reloaded" in follow_plan(path, 10, None)


def test_the_trace_headers_are_the_answering_models_at_each_response():
    trace = TraceHeaders([(b"x-model-version", b"aaa")])
    client = TestClient(RequestGuard(echo, api_key=None, max_body_bytes=100, trace_headers=trace))
    assert client.get("/healthz").headers["x-model-version"] == "aaa"
    trace.current = [(b"x-model-version", b"bbb")]  # what a swap does
    assert client.get("/healthz").headers["x-model-version"] == "bbb"
