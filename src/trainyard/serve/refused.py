"""A refusal: the 4xx (or 503) answer an endpoint gives instead of a prediction.

Its own module because three parts raise or answer it and none should import another for
it: the request parsing (trainyard.serve.parsing), the Predictor (an image that is no image)
and the batcher (a request shed under load). Each names the field at fault, so the JSON
answer is always ``{"error", "field"}``, counted on /metrics by reason.
"""

from __future__ import annotations

import bentoml
from starlette.responses import JSONResponse

from trainyard.core.errors import InputError
from trainyard.serve.metrics import count_refusal


class Refused(Exception):
    """A 4xx/503 answer: the message names the field and says what to send instead."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        field: str | None,
        reason: str,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.field, self.reason, self.headers = status, field, reason, headers

    @classmethod
    def from_input(cls, err: InputError, reason: str) -> Refused:
        """The answer for an InputError of the shared input code (its status and field)."""
        return cls(err.status, str(err), field=err.field, reason=reason)

    def response(self) -> JSONResponse:
        """The JSON answer ``{"error", "field"}``, counted on /metrics by reason."""
        count_refusal(self.reason)
        return JSONResponse({"error": str(self), "field": self.field}, self.status, self.headers)

    def answer(self, ctx: bentoml.Context) -> JSONResponse:
        """The response for an api method that takes ``ctx``: BentoML sets the status of
        what the method returns to ``ctx.response.status_code``, so it is set there too."""
        ctx.response.status_code = self.status
        return self.response()


def overloaded(max_latency_ms: int) -> Refused:
    """The 503 for a request the adaptive batcher shed (not answerable in time)."""
    return Refused(
        503,
        "server overloaded: the request could not be answered within "
        f"serve.max_latency_ms ({max_latency_ms} ms); retry shortly",
        field=None,
        reason="overloaded",
        headers={"retry-after": "1"},
    )
