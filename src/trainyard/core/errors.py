"""Errors meant for people: each says what was wrong, where, and what to do."""


class TrainyardError(Exception):
    """Base class; pipeline entry points print these without a traceback and exit 1."""


class ParamsError(TrainyardError):
    """params.yaml has an unknown key, a wrong type or an out-of-range value."""


class DataError(TrainyardError):
    """A data file is missing, corrupt, or does not match its checksum."""


class TrackingError(TrainyardError):
    """The MLflow tracking store cannot be reached or does not hold the expected run."""


class PromotionRefused(TrainyardError):
    """``trainyard promote`` / ``rollback`` cannot do what was asked as asked: an unknown
    model, version or alias, no shadow evidence, nothing to roll back to (exit 2)."""


class ExportError(TrainyardError):
    """The ONNX export failed or does not agree with PyTorch."""


class ProviderError(TrainyardError):
    """An ONNX Runtime execution provider was asked for but cannot be had."""


class ModelError(TrainyardError):
    """The model file is missing, unreadable, or not the one the pipeline recorded."""


class InputError(TrainyardError):
    """A request's input is unusable; ``status`` is the HTTP status the service answers.

    ``field`` names the offending part of the request (``image``, ``images[3][0][7]``) so a
    client can fix it without reading server logs.
    """

    def __init__(self, message: str, *, field: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.field = field
        self.status = status

    def to_json(self) -> dict[str, str | None]:
        return {"error": str(self), "field": self.field}


class Terminated(KeyboardInterrupt):
    """SIGTERM (``kill``, a scheduler, a container stop) raised in a stage: unwound exactly
    like a Ctrl-C, so the same clean-up runs (temp files removed, MLflow run KILLED)."""
