"""trainyard: a GPU-first MLOps pipeline for image classification."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("trainyard")
except PackageNotFoundError:  # running from a source tree that was not pip-installed
    __version__ = "0.0.0+unknown"

__all__ = ["__version__"]
