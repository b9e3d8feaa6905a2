"""OpenAI-shaped error answers of the HTTP API: ``{"error": {"message", "type", "param", "code"}}``.

:func:`error_response` builds any of them; :func:`unauthorized_response` is the 401 of a missing or unknown
API key (never repeating it), :func:`unavailable_response` the 503 with ``Retry-After`` of overload,
:func:`unsupported_response` the 404 of an OpenAI route not served (image variations),
:func:`validation_error_response` the 400/422 of a body that fails :class:`~deployments.schemas.
ImageGenerationRequest` (naming each field and the values it accepts), and :func:`find_request_error` digs a
replica's :class:`~bcg_core.errors.RequestError` out of Ray's wrapping.
"""

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError

from bcg_core.errors import RequestError, shown

from .schemas import ErrorBody, ErrorDetail, ImageGenerationRequest, RequestLimits, http_field_phrase

__all__ = ["UNSUPPORTED_ROUTES", "error_response", "find_request_error", "unauthorized_response",
           "unavailable_response", "unsupported_response", "validation_error_response"]


def error_response(status: int, message: str, param: str | None = None, type_: str | None = None,
                   code: str | None = None) -> JSONResponse:
    """An OpenAI-shaped error answer.

    Args:
        status: HTTP status code.
        message: human message naming the field and the values it accepts.
        param: the request field at fault, or None.
        type_: OpenAI error type; default ``"invalid_request_error"`` below 500, ``"server_error"`` above.
        code: OpenAI's machine-readable code (``"invalid_api_key"``), or None.
    """
    kind = type_ or ("server_error" if status >= 500 else "invalid_request_error")
    body = ErrorBody(error=ErrorDetail(message=message, type=kind, param=param, code=code))
    return JSONResponse(status_code=status, content=body.model_dump())


_AUTH_MESSAGES = {
    "missing": ("You didn't provide an API key. Send it in an Authorization header: 'Authorization: Bearer "
                "<key>' (the openai client: OpenAI(api_key=...)).", None),
    "malformed": ("The Authorization header is not 'Bearer <key>': send 'Authorization: Bearer <key>' (the scheme "
                  "'Bearer', a space, then the key; the openai client: OpenAI(api_key=...)).", None),
    "invalid": ("Incorrect API key provided. Use a key this server was configured with (auth.api_keys or "
                "auth.api_key_file).", "invalid_api_key"),
}


def unauthorized_response(reason: str) -> JSONResponse:
    """A 401 in OpenAI's error shape for a ``"missing"``, ``"malformed"`` or ``"invalid"`` key
    (:meth:`ApiKeys.check`), with ``WWW-Authenticate: Bearer``; it never repeats the key."""
    message, code = _AUTH_MESSAGES[reason]
    answer = error_response(401, message, code=code)
    answer.headers["WWW-Authenticate"] = "Bearer"
    return answer


UNSUPPORTED_ROUTES: dict[str, str] = {
    "/v1/images/variations": "image variations are not supported (OpenAI retired the endpoint); for a variation of "
                             "an image, edit it with POST /v1/images/edits (the openai client's images.edit) and a "
                             "prompt that describes it, at the strength you want (an image file, no mask), or "
                             "generate with POST /v1/images/generations",
}
"""OpenAI Images API routes answered with :func:`unsupported_response`, and what each answer says to use instead."""

UNSUPPORTED_STATUS = 404
"""Status of :func:`unsupported_response`: 404, as OpenAI answers a route it does not serve, and a status clients do
not retry (the ``openai`` client retries 5xx, so 501 would send every call three times)."""


def unsupported_response(route: str) -> JSONResponse:
    """The answer to an OpenAI route that is not served (:data:`UNSUPPORTED_ROUTES`): 404 in OpenAI's error shape,
    code ``unsupported_endpoint``, saying what is supported instead. The body is never read."""
    return error_response(UNSUPPORTED_STATUS, f"POST {route}: {UNSUPPORTED_ROUTES[route]}",
                          code="unsupported_endpoint")


def unavailable_response(message: str, retry_after_s: float, param: str | None = None,
                         code: str | None = None) -> JSONResponse:
    """A 503 answer with ``Retry-After`` in whole seconds (at least 1), for overload, a replica not ready and a
    server that stops (``code``: OpenAI's machine-readable code, or None)."""
    answer = error_response(503, message, param=param, code=code)
    answer.headers["Retry-After"] = str(max(1, round(retry_after_s)))
    return answer


def _path(loc: list[str]) -> str:
    """``lora[0].scale`` for pydantic's location ``('lora', 0, 'scale')``."""
    return loc[0] + "".join(f"[{p}]" if p.isdigit() else f".{p}" for p in loc[1:])


def validation_error_response(exc: ValidationError, limits: RequestLimits,
                              model: type[BaseModel] = ImageGenerationRequest) -> JSONResponse:
    """Turn a pydantic error of :class:`ImageGenerationRequest` (or of ``model``: :class:`~deployments.schemas.
    ImageEditRequest`) into an OpenAI error answer.

    Returns:
        400 when the body is not JSON, else 422; ``param`` is the first field at fault and the message
        lists every fault once, each with the values its field accepts (a fault inside a field, such as an entry of
        ``lora``, also says where: ``lora[0].scale``). Each value sent is quoted once, each list of allowed values
        given once: the unknown fields are named together before the list of fields, the faults inside one field
        together before what the field accepts, and an enumeration's values only in ``allowed``.
    """
    fields = ", ".join(model.model_fields)
    # (kind, field) -> its pieces, in the order first met: ("unknown", "") the unknown fields, named in one message;
    # ("inside", field) the faults inside a field (lora entries), in one message; ("text", i) a message of its own
    parts: dict[tuple[str, str], list[str]] = {}
    param: str | None = None
    status = 422
    for i, err in enumerate(exc.errors(include_url=False)):
        loc = [str(p) for p in err.get("loc", ())]
        name = loc[0] if loc else None
        kind = err.get("type", "")
        msg = str(err.get("msg", "")).removeprefix("Value error, ")
        own = ("text", str(i))
        if kind == "json_invalid":
            status = 400
            parts[own] = [f"request body is not valid JSON ({err.get('ctx', {}).get('error', msg)}); "
                          f"send a JSON object with the fields {fields}"]
            continue
        if name is None:
            parts[own] = [f"request body must be a JSON object with the fields {fields} ({msg})"]
            continue
        param = param or name
        if name == "cache" and (len(loc) > 1 or kind.startswith("union_tag")):  # inside the cache: by key, not tag
            parts.setdefault(("inside", name), []).append(_cache_fault(err, loc, msg))
        elif name == "cache" and kind != "extra_forbidden":  # not an object at all
            got = f" (got {shown(err['input'], 40)})" if "input" in err else ""
            parts[own] = [f"invalid 'cache'{got}: not an object; allowed: {http_field_phrase(name, limits)}"]
        elif len(loc) > 1:  # inside a field (an entry of lora): where in it; the field's message says what it accepts
            parts.setdefault(("inside", name), []).append(_inner_fault(err, loc, msg))
        elif kind == "extra_forbidden":
            parts.setdefault(("unknown", ""), []).append(f"'{name}'")
        elif kind == "missing":
            parts[own] = [f"'{name}' is required: {http_field_phrase(name, limits)}"]
        else:
            reason = "not a served value" if kind == "literal_error" else msg  # the values: in 'allowed' only
            got = f" (got {shown(err['input'], 40)})" if "input" in err else ""
            parts[own] = [f"invalid '{name}'{got}: {reason}; allowed: {http_field_phrase(name, limits)}"]
    messages = []
    for (kind, name), pieces in parts.items():
        if kind == "unknown":
            messages.append(f"unknown field{'s' if len(pieces) > 1 else ''} {', '.join(pieces)}; allowed fields: "
                            f"{fields}")
        elif kind == "inside":
            messages.append(f"invalid '{name}' ({'; '.join(pieces)}); allowed: {http_field_phrase(name, limits)}")
        else:
            messages.extend(pieces)
    return error_response(status, "; ".join(messages) or str(exc), param=param)


def _inner_fault(err: dict, loc: list[str], msg: str) -> str:
    """One fault inside a field, where it is: ``unknown key 'weight' at lora[0]``, ``lora[0].name is missing``,
    ``got 'x' at lora[0].scale: Input should be a valid number``."""
    kind = err.get("type", "")
    if kind == "extra_forbidden":
        return f"unknown key '{loc[-1]}' at {_path(loc[:-1])}"
    where = _path(loc)
    if kind == "missing":
        return f"{where} is missing"
    return (f"got {shown(err['input'], 40)} at {where}" if "input" in err else f"at {where}") + f": {msg}"


def _cache_fault(err: dict, loc: list[str], msg: str) -> str:
    """One fault inside ``cache``, named by the key of the engine's cache model (the tag pydantic puts in the location,
    ``cache.first_block.threshold``, left out): ``got 11 at cache.threshold: ...``, ``got 'fbc' at cache.method: not a
    served method``, ``cache.method is missing``."""
    kind = err.get("type", "")
    if kind == "union_tag_invalid":
        sent = err.get("input")
        return f"got {shown(sent.get('method') if isinstance(sent, dict) else sent, 40)} at cache.method: not a " \
               f"served method"
    if kind == "union_tag_not_found":
        return "cache.method is missing"
    return _inner_fault(err, [loc[0], *loc[2:]], msg)


def find_request_error(exc: BaseException) -> RequestError | None:
    """The :class:`RequestError` inside ``exc``, however Ray wrapped it, or None.

    Ray re-raises a replica's exception as a ``RayTaskError`` that usually also subclasses the original
    class (so ``isinstance`` works) and keeps the original in ``.cause``; both are checked, plus the
    ``__cause__`` chain, a bounded number of levels deep.
    """
    seen: BaseException | None = exc
    for _ in range(8):
        if seen is None:
            return None
        if isinstance(seen, RequestError):
            cause = getattr(seen, "cause", None)
            return cause if isinstance(cause, RequestError) else seen
        seen = getattr(seen, "cause", None) or seen.__cause__
    return None
