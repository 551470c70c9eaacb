"""Errors as OpenAI's API returns them: ``{"error": {"message", "type", "param", "code"}}``.

`RequestError` is what request handling raises for a bad request; it names the field
(``param``, a dotted path such as ``messages.0.content``) so clients can point at it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from dyngen_core.errors import DynGenError

INVALID_REQUEST = "invalid_request_error"


class RequestError(Exception):
    """A request the server refuses.

    message: what was wrong and what to do.
    param: the request field at fault (dotted path), or None.
    status: the HTTP status (400 unless said).
    code: OpenAI's machine-readable code (e.g. "model_not_found"), or None.
    kind: OpenAI's error type.
    """

    def __init__(self, message: str, param: str | None = None, *, status: int = 400,
                 code: str | None = None, kind: str = INVALID_REQUEST) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.code = code
        self.kind = kind

    def body(self) -> dict[str, Any]:
        """The JSON body of the error response."""
        return error_body(self.message, self.kind, self.param, self.code)


def error_body(message: str, kind: str, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """``{"error": {...}}`` in OpenAI's shape."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


# Location parts pydantic adds for the branches of a union (``str``, ``list[ContentPart]``,
# ``function-after[...]``): not request fields.
_BRANCH_NAMES = frozenset({"str", "int", "float", "bool", "dict", "list", "none", "literal"})


def field_path(location: Sequence[Any]) -> str | None:
    """A dotted request-field path from a validation error's location, without the leading
    ``body`` and without the names pydantic gives union branches."""
    parts = [str(p) for p in location if p != "body" and not _is_branch(p)]
    return ".".join(parts) or None


def _is_branch(part: Any) -> bool:
    if isinstance(part, int):
        return False
    text = str(part)
    return text in _BRANCH_NAMES or "[" in text


@contextmanager
def blame(param: str) -> Iterator[None]:
    """Turn a dyngen error (or ValueError) raised inside into a `RequestError` naming
    ``param``."""
    try:
        yield
    except RequestError:
        raise
    except (DynGenError, ValueError) as exc:
        raise RequestError(f"{param}: {exc}", param) from exc
