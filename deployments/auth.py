"""API keys: ``Authorization: Bearer <key>`` checked by the ingress against SHA-256 digests.

The ingress holds only digests (:class:`ApiKeys`): those of ``auth.api_keys`` (the config stores digests from
the moment it is read, :class:`~deployments.settings.AuthConfig`) and of the keys in ``auth.api_key_file``, read
and hashed here at start. A presented key is hashed once and compared with *every* stored digest by
:func:`hmac.compare_digest` (no early exit), so the time taken depends on neither which key matched nor how
much of a digest agreed; a key's length shows only in the SHA-256 of the presented key. Nothing here logs a
key or a digest; :class:`ApiKeys` prints as a count.
"""

from __future__ import annotations

import hmac
from pathlib import Path

from .settings import AuthConfig, api_key_digest

__all__ = ["ApiKeys", "read_key_file"]


def read_key_file(path: str | Path) -> list[str]:
    """The keys in ``path``: one a line, surrounding white space dropped, blank lines and ``#`` comments skipped.

    Raises:
        ValueError: the file cannot be read or holds no key (the message names the file, never a key).
    """
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"auth.api_key_file {str(p)!r} cannot be read ({type(e).__name__}); give a UTF-8 text "
                         f"file with one key a line") from None
    keys = [line.strip() for line in text.splitlines()]
    keys = [k for k in keys if k and not k.startswith("#")]
    if not keys:
        raise ValueError(f"auth.api_key_file {str(p)!r} holds no key: one key a line ('#' starts a comment)")
    return keys


class ApiKeys:
    """The digests of the keys a request may present.

    Args:
        digests: ``sha256:<hex>`` digests (:func:`deployments.settings.api_key_digest`).
    """

    def __init__(self, digests: list[str]):
        self._digests = tuple(bytes.fromhex(d.removeprefix("sha256:")) for d in dict.fromkeys(digests))

    @classmethod
    def from_config(cls, auth: AuthConfig) -> ApiKeys:
        """The digests of ``auth.api_keys`` and of the keys in ``auth.api_key_file`` (read now).

        Raises:
            ValueError: the key file cannot be read or holds no key.
        """
        digests = list(auth.api_keys)
        if auth.api_key_file is not None:
            digests += [api_key_digest(k) for k in read_key_file(auth.api_key_file)]
        return cls(digests)

    @property
    def enabled(self) -> bool:
        """True when requests must present a key."""
        return bool(self._digests)

    def __len__(self) -> int:
        return len(self._digests)

    def __repr__(self) -> str:
        return f"ApiKeys({len(self._digests)} digests)"

    def check(self, authorization: str | None) -> str | None:
        """Why ``authorization`` (the header's value) is refused, or None when it holds a known key.

        Returns:
            None (accepted, or no keys configured); ``"missing"`` (no header, or ``Bearer`` with no key);
            ``"malformed"`` (a header that is not ``Bearer <key>``: another scheme, or a bare key); ``"invalid"`` (a
            key that matches no digest).
        """
        if not self._digests:
            return None
        from fastapi.security.utils import get_authorization_scheme_param

        scheme, key = get_authorization_scheme_param(authorization)
        if not (authorization or "").strip() or (scheme.lower() == "bearer" and not key):
            return "missing"
        if scheme.lower() != "bearer" or not key:
            return "malformed"
        presented = bytes.fromhex(api_key_digest(key).removeprefix("sha256:"))
        found = 0
        for digest in self._digests:  # every digest, no early exit
            found |= hmac.compare_digest(presented, digest)
        return None if found else "invalid"
