"""trainyard: a GPU-first MLOps pipeline for image classification."""

from typing import Any

__all__ = ["__version__"]


def __getattr__(name: str) -> Any:
    """``__version__``, read on first use: importlib.metadata costs every process that
    imports trainyard (each command, each decode worker) 40-150 ms at start-up."""
    if name != "__version__":
        raise AttributeError(f"module 'trainyard' has no attribute {name!r}")
    from importlib.metadata import PackageNotFoundError, version

    try:
        found = version("trainyard")
    except PackageNotFoundError:  # running from a source tree that was not pip-installed
        found = "0.0.0+unknown"
    globals()["__version__"] = found
    return found
