"""Request bodies and query strings -> what the classifier needs, or a ``Refused`` 4xx.

Every refusal names the field at fault and says what to send instead; none reads more of a
request than it must. Multipart bodies are parsed once, by Starlette's parser, from the
bytes the request guard already read.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
from starlette.datastructures import FormData, Headers, UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.requests import Request

from trainyard.core.card import Card
from trainyard.core.config import ServeParams
from trainyard.core.errors import InputError
from trainyard.runtime.inputs import pixel_arrays
from trainyard.serve.refused import Refused

CLASSIFY_USAGE = (
    "send one image as a multipart file field 'image' (curl -F image=@photo.jpg URL/classify) "
    "or as the whole body with its image content type "
    "(curl --data-binary @photo.jpg -H 'Content-Type: image/jpeg' URL/classify)"
)
BATCH_USAGE = (
    "send image files as repeated multipart fields 'images' "
    "(curl -F images=@a.jpg -F images=@b.png URL/classify_batch), or JSON "
    '{"images": [arrays of 0–255 numbers shaped as GET /metadata input.image]}'
)
MAX_TOP_K_DIGITS = 9  # parse_top_k refuses longer numbers
_DEFAULTS = ServeParams()  # the limits when none are given
TRUE, FALSE = frozenset({"true", "1", "yes", "on"}), frozenset({"false", "0", "no", "off", ""})


def media_type(headers: Headers) -> str:
    """The Content-Type without its parameters, lower case ('' when there is none)."""
    return headers.get("content-type", "").split(";")[0].strip().lower()


def unsupported(path: str, media: str, usage: str) -> Refused:
    """The 415 for a body ``path`` does not take."""
    got = f"'{media}'" if media else "a body without a Content-Type"
    return Refused(
        415,
        f"{path} does not take {got}; {usage}",
        field="Content-Type",
        reason="unsupported_media_type",
    )


def parse_flag(name: str, value: str | None) -> bool:
    """A true/false form field or query parameter; absent or empty is false."""
    text = (value or "").strip().lower()
    if text in TRUE:
        return True
    if text in FALSE:
        return False
    raise Refused(
        400, f"{name}: expected true or false, got {value!r}", field=name, reason="bad_field"
    )


def parse_top_k(value: str | None, num_classes: int, default: int) -> int:
    """How many classes to list, at most ``num_classes``; ``default`` when not given."""
    if value is None:
        return min(default, num_classes)
    # isdecimal, not isdigit: '²' is a digit that int() refuses (it was a 500).
    # Length first: int() of 4301+ digits raises (it was a 500).
    text = value.strip()
    if not text.isdecimal() or len(text) > MAX_TOP_K_DIGITS or int(text) < 1:
        raise Refused(
            400,
            f"top_k: expected a whole number from 1 to {num_classes}, got {value!r}",
            field="top_k",
            reason="bad_field",
        )
    return min(int(text), num_classes)


def _too_many_files(files: str, max_files: int, usage: str) -> Refused:
    if files == "image":
        return Refused(
            400,
            f"image: expected one file field 'image', got more; {usage}",
            field="image",
            reason="bad_field",
        )
    return Refused(
        413,
        f"{files}: more than the limit of {max_files} per request "
        "(serve.max_batch_images); split them over several requests",
        field=files,
        reason="too_many_images",
    )


def _multipart_refusal(err: MultiPartException, files: str, max_files: int, usage: str) -> Refused:
    if err.message.startswith("Too many files"):
        return _too_many_files(files, max_files, usage)
    if err.message.startswith("Too many fields"):
        return Refused(
            400, f"body: too many text fields; {usage}", field="body", reason="bad_field"
        )
    return Refused(
        400,
        f"body: malformed multipart/form-data ({err.message}); {usage}",
        field="body",
        reason="bad_request",
    )


async def parse_form(
    request: Request,
    body: bytes,
    *,
    files: str,
    texts: tuple[str, ...],
    max_files: int,
    usage: str,
) -> FormData:
    """The multipart body, parsed once; unknown fields, text where a file belongs and a
    file where text belongs are 400s that name the field (a text ``image`` is never taken
    for a URL to fetch). The caller closes the form."""

    async def stream() -> AsyncIterator[bytes]:
        yield body

    try:
        # One more file than allowed is parsed, so "too many" is a 413 that says how many.
        form = await MultiPartParser(
            request.headers, stream(), max_files=max_files + 1, max_fields=len(texts) + 1
        ).parse()
    except MultiPartException as err:
        raise _multipart_refusal(err, files, max_files, usage) from None
    for key in form:
        if key != files and key not in texts:
            await form.close()
            raise Refused(400, f"{key}: unknown form field; {usage}", field=key, reason="bad_field")
    for key in texts:
        if any(isinstance(v, UploadFile) for v in form.getlist(key)):
            await form.close()
            raise Refused(400, f"{key}: must be text, not a file", field=key, reason="bad_field")
    return form


async def file_fields(form: FormData, name: str, usage: str) -> list[bytes]:
    """The bytes of every file under ``name``; a text value there is a 400."""
    out = []
    for i, value in enumerate(form.getlist(name)):
        if not isinstance(value, UploadFile):
            where = name if name == "image" else f"{name}[{i}]"
            raise Refused(
                400,
                f"{where}: must be a file upload, not text; {usage}",
                field=where,
                reason="bad_field",
            )
        out.append(await value.read())
    return out


def form_text(form: FormData, key: str) -> str | None:
    """A text field of the form, or None when absent (files were refused already)."""
    value = form.get(key)
    return value if isinstance(value, str) else None


def check_count(n: int, limit: int) -> None:
    """Refuse a batch of no images (400) or of more than ``limit`` (413)."""
    if n == 0:
        raise Refused(
            400, f"images: no image files; {BATCH_USAGE}", field="images", reason="bad_field"
        )
    if n > limit:
        raise Refused(
            413,
            f"images: more than the limit of {limit} per request (serve.max_batch_images); "
            "split them over several requests",
            field="images",
            reason="too_many_images",
        )


def _json_refusal(status: int, message: str, reason: str = "bad_request") -> Refused:
    return Refused(status, f"body: {message}; {BATCH_USAGE}", field="body", reason=reason)


def check_json_shape(body: bytes, params: ServeParams) -> None:
    """Refuse a body nested deeper than ``max_json_depth`` (json's recursion would fail: a
    500) or holding more than ``max_json_values`` values, counted in one vectorised pass."""
    masked = _outside_strings(body)
    opens = (masked == ord("[")) | (masked == ord("{"))
    closes = (masked == ord("]")) | (masked == ord("}"))
    depth = int(np.cumsum(opens.astype(np.int64) - closes).max(initial=0))
    if depth > params.max_json_depth:
        raise _json_refusal(
            400,
            f"JSON nested {depth} levels deep, more than the limit of {params.max_json_depth} "
            "(serve.max_json_depth)",
            "json_too_deep",
        )
    values = int(np.count_nonzero(masked == ord(","))) + 1
    if values > params.max_json_values:
        raise _json_refusal(
            413,
            f"JSON with about {values:,} values, more than the limit of {params.max_json_values:,} "
            "(serve.max_json_values); split the images over several requests",
            "json_too_large",
        )


def _outside_strings(body: bytes) -> np.ndarray:
    """The body's bytes with those inside JSON strings zeroed (linear, no regex: a body of
    escaped quotes would make a string regex quadratic)."""
    raw = np.frombuffer(body, dtype=np.uint8)
    idx = np.arange(raw.size)
    backslash = raw == ord("\\")
    # Index of the last byte that is not a backslash, at or before each position.
    last_plain = np.maximum.accumulate(np.where(backslash, -1, idx))
    quotes = np.flatnonzero(raw == ord('"'))
    run = (quotes - 1) - last_plain[np.maximum(quotes - 1, 0)]  # backslashes just before
    run[quotes == 0] = 0
    toggles = np.zeros(raw.size, dtype=np.int8)
    toggles[quotes[run % 2 == 0]] = 1  # unescaped quotes open and close strings
    inside = (np.cumsum(toggles) % 2 == 1) | (toggles == 1)
    return np.where(inside, 0, raw)


class _LongNumber(ValueError):
    pass


def _int_parser(max_digits: int) -> Any:
    def parse_int(text: str) -> int:
        if len(text.lstrip("-")) > max_digits:
            raise _LongNumber(len(text.lstrip("-")))
        return int(text)

    return parse_int


def json_images(body: bytes, params: ServeParams = _DEFAULTS) -> Any:
    """The ``images`` of a JSON batch body ``{"images": [...]}``, not yet checked; the
    body is first held to ``params``' serve.max_json_* limits."""
    check_json_shape(body, params)
    try:
        doc = json.loads(body, parse_int=_int_parser(params.max_json_int_digits))
    except _LongNumber as err:
        raise _json_refusal(
            400,
            f"a JSON integer of {err.args[0]:,} digits, more than the limit of "
            f"{params.max_json_int_digits} (serve.max_json_int_digits); pixels are 0–255",
            "json_number_too_long",
        ) from None
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise _json_refusal(400, f"Invalid JSON ({err})") from None
    except (ValueError, RecursionError) as err:  # any other parser limit: still the body's
        raise _json_refusal(400, f"Invalid JSON ({type(err).__name__})") from None
    if not isinstance(doc, dict) or "images" not in doc:
        raise Refused(400, f"images: missing; {BATCH_USAGE}", field="images", reason="bad_field")
    unknown = sorted(set(doc) - {"images"})
    if unknown:
        raise Refused(
            400,
            f"{unknown[0]}: unknown field; {BATCH_USAGE}",
            field=unknown[0],
            reason="bad_field",
        )
    return doc["images"]


def json_pixels(
    body: bytes, card: Card, max_images: int, params: ServeParams = _DEFAULTS
) -> np.ndarray:
    """A JSON batch body -> float32 pixels [N,C,H,W] by the card, or a 4xx naming the item."""
    images = json_images(body, params)
    try:
        return pixel_arrays(images, card, max_images=max_images)
    except InputError as err:
        reason = "too_many_images" if err.status == 413 else "bad_field"
        raise Refused.from_input(err, reason) from None
