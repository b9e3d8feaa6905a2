"""The routing key of a DiT request: its bucket shape and its LoRA adapters, as one typed value.

A request travels to the DiT deployment with its key in ``RequestMetadata.multiplexed_model_id``
(``handle.options(multiplexed_model_id=str(key))``), a string: :meth:`RoutingKey.__str__` writes it and
:meth:`RoutingKey.parse` reads it, once, where it arrives (the router's ``choose_replicas``, the replica's
``generate``). Everything between works on the value.

Wire form: the bucket shape (``BucketKey.shape``, e.g. ``"i1024_t256"``; ``""`` for a request without a bucket),
then, when the request carries adapters, ``|lora=`` and their names sorted and comma-separated:
``"i1024_t256|lora=anime,ink"``. An adapter name never holds ``|`` or ``,`` (``bcg_core.lora.files.NAME_RE``).

Pure: no Ray, no torch.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

__all__ = ["RoutingKey"]

_LORA = "|lora="
"""Separator of the adapters in the wire form."""


@dataclass(frozen=True)
class RoutingKey:
    """Where a request should go: the replicas owning ``shape``, preferring those holding ``adapters``.

    Attributes:
        shape: the request's bucket shape (``"i1024_t256"``); ``""`` for a request without a bucket (a miss, or
            an un-keyed call): any replica, at once.
        adapters: the names of the request's LoRA adapters (empty: none).
    """

    shape: str = ""
    adapters: frozenset[str] = field(default_factory=frozenset)

    @classmethod
    def of(cls, shape: str = "", adapters: Iterable[str] = ()) -> RoutingKey:
        """The key of a request of bucket shape ``shape`` with LoRA ``adapters`` (names; repeats collapse)."""
        return cls(shape, frozenset(adapters))

    @classmethod
    def parse(cls, text: str | None) -> RoutingKey:
        """The key written by :meth:`__str__`; ``None`` or ``""`` is the un-keyed key. Never raises: a malformed
        name list yields the names it holds (empty names dropped)."""
        shape, sep, names = (text or "").partition(_LORA)
        return cls(shape, frozenset(n for n in names.split(",") if n) if sep else frozenset())

    @property
    def keyed(self) -> bool:
        """Whether the request has a bucket shape (owners exist); False for a miss or an un-keyed call."""
        return bool(self.shape)

    def __str__(self) -> str:
        """The wire form (module docstring): the shape, then ``|lora=`` and the sorted names when there are any."""
        return self.shape + (_LORA + ",".join(sorted(self.adapters)) if self.adapters else "")
