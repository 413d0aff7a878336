"""trainyard: a GPU-first MLOps pipeline for image classification."""

from __future__ import annotations

__all__ = ["__version__"]


def __getattr__(name: str) -> str:
    """``trainyard.__version__``, read from the installed metadata when first asked for:
    importlib.metadata costs about 80 ms to import, which every stage, service worker and
    ``trainyard`` command would pay at start-up for a value few of them use (PEP 562)."""
    if name != "__version__":
        raise AttributeError(f"module 'trainyard' has no attribute {name!r}")
    from importlib.metadata import PackageNotFoundError, version

    try:
        found = version("trainyard")
    except PackageNotFoundError:  # running from a source tree that was not pip-installed
        found = "0.0.0+unknown"
    globals()["__version__"] = found
    return found
