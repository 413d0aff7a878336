"""A worker process's start and end: a frozen heap after loading, a clean stop on SIGTERM."""

from __future__ import annotations

import gc
import os
import signal
import socket
from typing import Any

import psutil

# The collector's thresholds in a serving worker, generations 0, 1 and 2 (CPython's: 700,
# 10, 10). A small model's request leaves ~120 container objects in gen 0 (closures and
# futures in cycles, freed only by the collector): at 700 a worker collected gen 0 every
# ~6 requests, promoted what was still in flight, and ran a 15 ms full collection every
# ~700 (py-spy and gc.callbacks under wrk, Fashion CNN, 1 worker, 16 connections: 0.05
# ms of CPU a request, ~6%, and the full collections in p99). At 20,000 the cycles die in
# gen 0 and almost nothing is promoted: 0.001 ms a request (docs/benchmarks.md, "Issue 44,
# third pass"). The cost: up to 20,000 dead objects wait a little longer, a few MB.
SERVING_GC_THRESHOLDS = (20_000, 20, 100)


def freeze_heap() -> None:
    """Move everything allocated so far out of the garbage collector's sight, and collect
    the young generation less often (``SERVING_GC_THRESHOLDS``).

    Everything built at start-up (BentoML's app and middleware, pydantic, ONNX Runtime, the
    model, the first inference) lives as long as the process: freezing it keeps the
    collector from re-scanning it on every full collection, which stalled ~1% of requests
    for 50-150 ms (p99; make bench-serve). Call it once start-up is over.
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(*SERVING_GC_THRESHOLDS)


def stop_listening_on_sigterm() -> None:
    """On SIGTERM, stop the port listening before uvicorn drains (test_serving_drain.py).

    BentoML already drains: `bentoml serve` (circus) passes SIGTERM on to each worker,
    whose uvicorn stops accepting, lets every request in flight finish (each bounded by
    serve.timeout_s) and exits; then the main process exits 0. But the listening socket
    is shared with the main process, which closes it only after the last worker has gone,
    so meanwhile the kernel still completes new connections into the backlog, and they
    are reset when it closes. ``shutdown()`` on the shared socket stops it listening for
    every process at once: a new connection is refused (safe for a client or proxy to
    retry elsewhere) rather than reset after its request was sent. uvicorn's own handler
    then runs as before. Call it in the worker, after uvicorn installed its handler.
    """
    listening = [
        conn.fd
        for conn in psutil.Process().net_connections("tcp")
        if conn.status == psutil.CONN_LISTEN and conn.fd >= 0
    ]
    uvicorn_handler = signal.getsignal(signal.SIGTERM)
    if not listening or not callable(uvicorn_handler):
        return

    def stop_listening(sig: int, frame: Any) -> None:
        for fd in listening:
            try:
                with socket.socket(fileno=os.dup(fd)) as sock:
                    sock.shutdown(socket.SHUT_RDWR)
            except OSError:  # already shut by another worker, or closed
                pass
        uvicorn_handler(sig, frame)

    signal.signal(signal.SIGTERM, stop_listening)


def bind_api_methods(instance: Any) -> list[str]:
    """Build each ``@bentoml.api`` method's caller once, on ``instance``; the names bound.

    BentoML looks the method up on the service instance for every request (and its batcher
    once more per batch), and ``APIMethod.__get__`` then builds a new caller each time, with
    ``inspect.signature`` and ``functools.wraps``: about 3% of a small model's request
    (py-spy, docs/serving.md "What BentoML costs per request"). The caller it builds is the
    same each time, and an api method is a non-data descriptor (no ``__set__``), so the one
    kept in the instance's ``__dict__`` is found first. An instance behind a proxy (BentoML's
    ``__self_proxy__``, a service another one depends on) is left as BentoML makes it.
    """
    if getattr(instance, "__self_proxy__", None) is not None:
        return []
    bound = []
    for name, attr in vars(type(instance)).items():
        if hasattr(attr, "input_spec") and hasattr(attr, "_local_call"):
            setattr(instance, name, attr.__get__(instance, type(instance)))
            bound.append(name)
    return bound
