"""VAEs called from several threads: the decode thread, edits' encode thread and previews share one VAE."""

from __future__ import annotations

import functools
import threading

import torch

__all__ = ["has_call_state", "serialize_stateful_vae"]


def has_call_state(vae: torch.nn.Module) -> bool:
    """Whether ``vae`` keeps per-call state on the module (``clear_cache``: diffusers' ``AutoencoderKLQwenImage``
    keeps its causal-convolution caches in ``_feat_map`` and ``_enc_feat_map``), so that two calls at once mix it."""
    return hasattr(vae, "clear_cache")


def serialize_stateful_vae(vae: torch.nn.Module) -> bool:
    """Give a VAE that keeps per-call state on the module one lock around its ``encode`` and ``decode``; True if it
    has such state (and now the lock).

    diffusers' ``AutoencoderKLQwenImage`` keeps its causal-convolution caches on the module: ``clear_cache()``
    resets the encoder's and the decoder's at the start and end of every ``encode`` and ``decode``, and the calls
    write into them. bcg-serve calls the VAE from several threads (the decode thread, edits' encode thread,
    previews), and two such calls at once silently give wrong images or raise: on a tiny Qwen-Image VAE, two
    threads decoding for 10 s gave 63 and 52 wrong outputs and no error. Stateless VAEs (``AutoencoderKL``,
    ``AutoencoderDC``: no ``clear_cache``) are left as they are.
    """
    if not has_call_state(vae) or "_bcg_lock" in vae.__dict__:
        return "_bcg_lock" in vae.__dict__
    lock = threading.RLock()
    for name in ("encode", "decode"):
        method = getattr(vae, name)

        @functools.wraps(method)
        def locked(*args, _method=method, **kwargs):
            with lock:
                return _method(*args, **kwargs)
        setattr(vae, name, locked)  # an instance attribute: every caller of vae.encode / vae.decode takes it
    vae._bcg_lock = lock
    return True
