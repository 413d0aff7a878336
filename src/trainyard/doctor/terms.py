"""What the doctor's modules share: verdict levels, provider names, sizes in words, and the
shape of a verdict."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

DEFAULT_DATA = Path("data/prepared")
OK, WARN, ERROR = "ok", "warn", "error"
CUDA_EP = "CUDAExecutionProvider"
TRT_EP = "TensorrtExecutionProvider"
CPU_EP = "CPUExecutionProvider"
SHORT = {CUDA_EP: "CUDA", TRT_EP: "TensorRT", CPU_EP: "CPU"}


def human_bytes(n: float | None) -> str:
    """``1.5 GiB``, ``44.9 MiB``; ``?`` when unknown."""
    if n is None:
        return "?"
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def make_verdict(check: str, level: str, verdict: str, why: str, **extra: Any) -> dict[str, Any]:
    """One verdict: ``{check, level (ok|warn|error), verdict, why}`` plus ``extra`` facts."""
    return {"check": check, "level": level, "verdict": verdict, "why": why, **extra}


def safely(fn: Callable[..., dict[str, Any]], *args: Any) -> dict[str, Any]:
    """A collector's facts, or ``{"error": ...}``: one unreadable fact never hides the rest."""
    try:
        return fn(*args)
    except Exception as err:  # the doctor reports a failure; it must not become one
        return {"error": f"{type(err).__name__}: {err}"}


def short_name(provider: str) -> str:
    """``CUDA`` for ``CUDAExecutionProvider``: how the report names a provider."""
    return SHORT.get(provider, provider.removesuffix("ExecutionProvider"))


def load_word(probe: dict[str, Any]) -> str:
    """A provider probe's outcome in words: loads, does not load, not tried."""
    loads = probe.get("loads")
    return "loads" if loads else "not tried" if loads is None else "does not load"
