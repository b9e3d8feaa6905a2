"""Errors that carry an HTTP status: bad input is answered, never crashes a replica."""

from __future__ import annotations

__all__ = ["BucketMissError", "NonFiniteOutput", "RequestCancelled", "RequestError", "ServiceUnavailable", "first_line",
           "non_finite_error", "require_finite", "shown"]


class RequestError(ValueError):
    """A request that cannot be served as asked; the ingress answers it with ``status``.

    Attributes:
        field: the request field at fault (``"prompt"``, ``"n"``, ``"size"``, ``"num_inference_steps"``,
            ``"guidance_scale"``, ``"negative_prompt"``, ``"seed"``).
        message: the whole message, naming the field and the allowed values.
        status: HTTP status code to answer with (422 unless said otherwise).
    """

    def __init__(self, field: str, message: str, status: int = 422):
        super().__init__(message)
        self.field = field
        self.message = message
        self.status = status

    def __reduce__(self):
        # Keep field and status when Ray pickles the error across processes.
        return (type(self), (self.field, self.message, self.status))


class BucketMissError(RequestError):
    """A request no bucket holds, under the reject miss policy (HTTP 422).

    Attributes:
        missed: the key dimensions that missed (``"batch"``, ``"image_tokens"``, ``"text_tokens"``), so
            that whoever rejects it can still count the miss by dimension.
    """

    def __init__(self, field: str, message: str, missed: tuple[str, ...] = (), status: int = 422):
        super().__init__(field, message, status)
        self.missed = tuple(missed)

    def __reduce__(self):
        return (type(self), (self.field, self.message, self.missed, self.status))


class RequestCancelled(Exception):
    """The caller gave up on a request (its client went away); raised between denoising steps."""


class NonFiniteOutput(RuntimeError):
    """A request's denoised latents hold NaN or inf: a broken kernel, adapter or checkpoint, never an image to
    send. Decoded, NaN turns quietly into a black or garbled picture (diffusers' ``postprocess`` casts it to
    uint8); instead the request fails (HTTP 500, ``generation failed: NonFiniteOutput``; this message goes to the
    replica's log) and the replica goes on serving."""


def non_finite_error(latents) -> NonFiniteOutput:
    """The :class:`NonFiniteOutput` of ``latents`` (rows, ...), naming the share of its values that are not finite."""
    share = 1.0 - latents.isfinite().float().mean().item()
    return NonFiniteOutput(f"the denoised latents hold NaN or inf values ({share:.1%} of them): no image was "
                           f"decoded; /v1/buckets shows each bucket's kernels")


def require_finite(state):
    """``state`` (a :class:`~bcg_core.request.RequestState`) after checking that its ``latents`` (rows, ...) are
    all finite; called right before the VAE decode of a request served alone (the step scheduler's decode thread
    checks after its batched decode instead, ``Finisher._decode``).

    Raises:
        NonFiniteOutput: a NaN or inf in ``state.latents`` (:func:`non_finite_error`).
    """
    if not bool(state.latents.isfinite().all()):
        raise non_finite_error(state.latents)
    return state


class ServiceUnavailable(RequestError):
    """The request was accepted but cannot be served now; the client may retry (HTTP 503 with ``Retry-After``):
    the GPU ran out of memory during its step, every replica is busy, or its replica died.

    Attributes:
        retry_after_s: seconds the client should wait before retrying.
    """

    def __init__(self, field: str, message: str, status: int = 503, retry_after_s: float = 2.0):
        super().__init__(field, message, status)
        self.retry_after_s = retry_after_s

    def __reduce__(self):
        return (type(self), (self.field, self.message, self.status, self.retry_after_s))


def first_line(exc: BaseException, empty: str = "", limit: int | None = None) -> str:
    """The first line of ``exc``'s message (surrounding blank space dropped), at most ``limit`` characters; ``empty``
    when the message is empty. For log lines and notes that quote an error from a library (torch, diffusers)."""
    text = str(exc).strip()
    return (text.splitlines()[0] if text else empty)[:limit]


def shown(value: object, limit: int = 60) -> str:
    """``value`` as an error message quotes what a request sent: ``true``, ``false`` and ``null`` as JSON spells
    them (what the client sent), anything else its ``repr``, cut to ``limit`` characters with ``...``; a list or
    tuple too long for that reads ``a list of N entries`` (a cut repr of a list of objects names none of them
    usefully)."""
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    text = repr(value)
    if len(text) <= limit:
        return text
    if isinstance(value, (list, tuple)):
        return f"a list of {len(value)} entries"
    return text[:limit - 3] + "..."
