"""The transformer cut after its first block: the two halves of a First Block Cache step, as diffusers' hooks cut it.

diffusers' First Block Cache (``diffusers/hooks/first_block_cache.py``) hooks the first block of the transformer's
block lists (the *head*), every later block, and the last one (the *tail*): the head's output residual decides, for
the whole forward, whether the remaining blocks run or their residual from the last computed step is added to the
head's output instead. bcg-serve decides per request inside a batched forward, so it runs the two halves as two
forwards of the same transformer, each with the blocks set to one *phase* (:class:`BlockSplit`):

- :class:`HeadPhase`: the head block runs; its output (image stream ``hidden``, text stream ``encoder``) and its
  residual ``hidden - hidden_in`` are recorded; each row's cached residual of the remaining blocks is added to the
  head's output, and every later block returns its inputs (as diffusers' ``FBCBlockHook`` does when a step is
  skipped). The forward's output is therefore the *reused* step of every row: diffusers' output of a skipped step.
- :class:`TailPhase`: the head block returns the recorded head output of each row without computing; the remaining
  blocks run; the tail block's output minus the head output is recorded as the new cached residual. The forward's
  output is the *computed* step: diffusers' output when the remaining blocks run.

Everything outside the blocks (embeddings, ``norm_out``, ``proj_out``) runs in both halves, as in both of
diffusers' paths. Which block outputs are the image and text streams is diffusers' own record of each block class
(``TransformerBlockRegistry``: FLUX.1's double and single blocks return ``(encoder, hidden)``). A transformer whose
first and last blocks differ in that layout (FLUX.2: its single blocks return one joint stream) is refused, as
diffusers' hook fails on it.

The phase is per thread (the step thread sets it around its forwards; a background compile's forwards on another
thread see none), so the blocks run unchanged everywhere else.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator

import torch

__all__ = ["BlockSplit", "block_names", "HeadPhase", "TailPhase", "installed_split", "pad_rows", "split_of"]

HEAD, MIDDLE, TAIL = "head", "middle", "tail"


def _block_lists(transformer: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """``(name, block)`` of every block of the transformer's block lists, in the order its forward runs them: the
    children that diffusers' hooks treat as block lists (``_ALL_TRANSFORMER_BLOCK_IDENTIFIERS``), in definition
    order, as ``apply_first_block_cache`` collects them."""
    from diffusers.hooks._common import _ALL_TRANSFORMER_BLOCK_IDENTIFIERS

    blocks = []
    for name, child in transformer.named_children():
        if name in _ALL_TRANSFORMER_BLOCK_IDENTIFIERS and isinstance(child, torch.nn.ModuleList):
            blocks += [(f"{name}.{i}", b) for i, b in enumerate(child)]
    return blocks


def block_names(transformer: torch.nn.Module) -> list[str]:
    """The names of the transformer's blocks in the order its forward runs them (the first is the head, the last
    the tail), as diffusers' ``apply_first_block_cache`` orders them."""
    return [name for name, _ in _block_lists(transformer)]


class _Streams:
    """One block class's stream layout (diffusers' ``TransformerBlockMetadata``): where its outputs put the image
    and text streams, and how its inputs are read."""

    def __init__(self, cls: type):
        from diffusers.hooks._helpers import TransformerBlockRegistry

        try:
            self.meta = TransformerBlockRegistry.get(cls)
        except ValueError as e:
            raise ValueError(f"{cls.__name__} is not in diffusers' TransformerBlockRegistry, so its outputs' streams "
                             f"are unknown: this transformer takes no step cache") from e
        self.hidden_index = self.meta.return_hidden_states_index
        self.encoder_index = self.meta.return_encoder_hidden_states_index

    def inputs(self, args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The block's ``(hidden_states, encoder_hidden_states or None)`` inputs."""
        hidden = self.meta._get_parameter_from_args_kwargs("hidden_states", args, kwargs)
        encoder = (self.meta._get_parameter_from_args_kwargs("encoder_hidden_states", args, kwargs)
                   if self.encoder_index is not None else None)
        return hidden, encoder

    def outputs(self, output) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The block's output as ``(hidden, encoder or None)``."""
        if not isinstance(output, tuple):
            return output, None
        return output[self.hidden_index], (output[self.encoder_index] if self.encoder_index is not None else None)

    def pack(self, hidden: torch.Tensor, encoder: torch.Tensor | None):
        """``(hidden, encoder)`` in the block's output layout."""
        if self.encoder_index is None:
            return hidden
        out = [None, None]
        out[self.hidden_index], out[self.encoder_index] = hidden, encoder
        return tuple(out)


def pad_rows(out: torch.Tensor, rows: dict[int, torch.Tensor]) -> torch.Tensor:
    """Write per-row tensors of real tokens into ``out`` (``(B, L, D)``, e.g. a graph's input buffer): row ``i``
    starts with ``rows[i]`` (``(l, D)``, ``l <= L``), everything else zero. Returns ``out``."""
    out.zero_()
    for i, t in rows.items():
        out[i, : t.shape[0]].copy_(t)
    return out


def _padded(like: torch.Tensor, rows: dict[int, torch.Tensor]) -> torch.Tensor:
    """Per-row tensors of real tokens placed in a new tensor of a forward's padded layout, shaped as ``like``
    (:func:`pad_rows`)."""
    return pad_rows(torch.empty_like(like), rows)


class HeadPhase:
    """The head half of a step (see the module docstring).

    Args:
        residuals: bucket row -> ``(hidden (S_r, D), encoder (T_r, D) or None)``: that row's cached residuals of the
            remaining blocks over its real tokens (image stream, then text stream). Rows without one get zero
            residuals (their output is then not a reused step and is not used).

    Attributes (set by the forward):
        hidden, encoder: the head block's outputs, ``(B, S, D)`` and ``(B, T, D)`` in the forward's padded layout
            (``encoder`` None for a block without a text stream).
        residual: ``hidden - hidden_in``, ``(B, S, D)``: what the cache decision compares between steps.
    """

    def __init__(self, residuals: dict[int, tuple[torch.Tensor, torch.Tensor | None]] | None = None,
                 static: tuple[torch.Tensor, torch.Tensor | None] | None = None):
        self.residuals = residuals or {}
        self.static = static
        """A captured graph's padded residual buffers ``(B, S, D)``, ``(B, T, D)``, used as they are (filled before each
        replay) instead of :attr:`residuals`."""
        self.hidden: torch.Tensor | None = None
        self.encoder: torch.Tensor | None = None
        self.residual: torch.Tensor | None = None

    def block(self, role: str, streams: _Streams, forward, args: tuple, kwargs: dict):
        hidden_in, encoder_in = streams.inputs(args, kwargs)
        if role != HEAD:  # diffusers' FBCBlockHook on a skipped step: the block returns its inputs
            return streams.pack(hidden_in, encoder_in)
        hidden, encoder = streams.outputs(forward(*args, **kwargs))
        self.hidden, self.encoder, self.residual = hidden, encoder, hidden - hidden_in
        if self.static is not None:
            res_hidden, res_encoder = self.static
        else:
            res_hidden = _padded(hidden, {i: h for i, (h, _) in self.residuals.items()})
            res_encoder = None if encoder is None else _padded(
                encoder, {i: e for i, (_, e) in self.residuals.items() if e is not None})
        # FBCHeadBlockHook: tail_block_residuals[0] + output[hidden], tail_block_residuals[1] + output[encoder]
        return streams.pack(res_hidden + hidden, None if encoder is None else res_encoder + encoder)


class TailPhase:
    """The tail half of a step (see the module docstring).

    Args:
        hidden, encoder: the rows' head block outputs over their real tokens, ``(m, S, D)`` and ``(m, T, D)``
            (``encoder`` None for a block without a text stream); placed in the forward's padded layout (pad tokens
            and pad rows zero) when the head block is reached.

    Attributes (set by the forward):
        residual_hidden, residual_encoder: the remaining blocks' residuals in the forward's padded layout, the tail
            block's outputs minus the head outputs (diffusers' ``tail_block_residuals``).
    """

    def __init__(self, hidden: torch.Tensor, encoder: torch.Tensor | None, static: bool = False):
        self.hidden, self.encoder = hidden, encoder
        self.static = static
        """``hidden`` and ``encoder`` are a captured graph's padded input buffers (``(B, S, D)``, ``(B, T, D)``, filled
        before each replay), used as they are."""
        self._padded: tuple[torch.Tensor, torch.Tensor | None] | None = None
        self.residual_hidden: torch.Tensor | None = None
        self.residual_encoder: torch.Tensor | None = None

    def block(self, role: str, streams: _Streams, forward, args: tuple, kwargs: dict):
        if role == HEAD and self.static:  # computed in the head half, placed in the graph's input buffers
            self._padded = (self.hidden, self.encoder)
            return streams.pack(self.hidden, self.encoder)
        if role == HEAD:  # computed in the head half
            hidden_in, encoder_in = streams.inputs(args, kwargs)
            hidden = _padded(hidden_in, dict(enumerate(self.hidden)))
            encoder = None if self.encoder is None else _padded(encoder_in, dict(enumerate(self.encoder)))
            self._padded = (hidden, encoder)
            return streams.pack(hidden, encoder)
        output = forward(*args, **kwargs)
        if role == TAIL:
            hidden, encoder = streams.outputs(output)
            self.residual_hidden = hidden - self._padded[0]
            self.residual_encoder = None if encoder is None else encoder - self._padded[1]
        return output


class BlockSplit:
    """Phase switches on every block of a transformer's block lists (installed once per transformer:
    :func:`installed_split`).

    Each block's ``forward`` is wrapped: with no phase set on the calling thread it runs as before (the compiled
    tier's switch included: kernels installed later go under the wrappers, :meth:`around`); inside :meth:`phase` it
    runs as the phase says.

    Args:
        transformer: a diffusers transformer whose block lists diffusers' hooks know.

    Raises:
        ValueError: fewer than two blocks, a block class diffusers' ``TransformerBlockRegistry`` does not describe,
            or a first and a last block of different stream layouts (one returns a text stream, the other none:
            FLUX.2's double-stream first and single-stream last block), where diffusers' ``FBCBlockHook`` fails (its
            tail residual subtracts the head's two outputs from the tail's one: ``TypeError``).
    """

    def __init__(self, transformer: torch.nn.Module):
        blocks = _block_lists(transformer)
        if len(blocks) < 2:
            raise ValueError(f"{type(transformer).__name__} has {len(blocks)} block(s) in its block lists; the first "
                             f"block cache needs a first block and at least one more")
        streams: dict[type, _Streams] = {}
        head, tail = (streams.setdefault(type(b), _Streams(type(b))) for b in (blocks[0][1], blocks[-1][1]))
        if (head.encoder_index is None) != (tail.encoder_index is None):
            with_text, without = (blocks[0], blocks[-1]) if tail.encoder_index is None else (blocks[-1], blocks[0])
            raise ValueError(f"{type(transformer).__name__}: its first block {blocks[0][0]} and its last block "
                             f"{blocks[-1][0]} differ in stream layout ({type(with_text[1]).__name__} returns a text "
                             f"stream, {type(without[1]).__name__} none), where diffusers' First Block Cache fails "
                             f"(FBCBlockHook's tail residual): this transformer takes no first block cache")
        self.names = [name for name, _ in blocks]
        self._local = threading.local()
        self._blocks: list[tuple[torch.nn.Module, object, str, _Streams]] = []
        """Per block: the module, the forward the split wraps, its role and its stream layout."""
        for i, (_, block) in enumerate(blocks):
            s = streams.setdefault(type(block), _Streams(type(block)))
            role = HEAD if i == 0 else TAIL if i == len(blocks) - 1 else MIDDLE
            self._blocks.append((block, block.forward, role, s))
            block.forward = self._wrap(block.forward, role, s)

    def around(self, install):
        """Call ``install()`` with the blocks' own forwards in place (the split's wrappers taken off), then wrap
        whatever forwards it installed: compiled kernels installed on a model whose split is already installed
        compile the blocks, never the split's switch. Returns what ``install`` returns."""
        for block, inner, _, _ in self._blocks:
            block.forward = inner
        try:
            return install()
        finally:
            for i, (block, _, role, streams) in enumerate(self._blocks):
                self._blocks[i] = (block, block.forward, role, streams)
                block.forward = self._wrap(block.forward, role, streams)

    def _wrap(self, forward, role: str, streams: _Streams):
        local = self._local

        def split_forward(*args, **kwargs):
            phase = getattr(local, "phase", None)
            if phase is None:
                return forward(*args, **kwargs)
            return phase.block(role, streams, forward, args, kwargs)

        split_forward.bcg_block_split = True
        return split_forward

    @contextlib.contextmanager
    def phase(self, phase: HeadPhase | TailPhase) -> Iterator[HeadPhase | TailPhase]:
        """Forwards of the transformer on this thread run as ``phase`` until the block exits."""
        before = getattr(self._local, "phase", None)
        self._local.phase = phase
        try:
            yield phase
        finally:
            self._local.phase = before


_SPLITS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_SPLITS_LOCK = threading.Lock()


def installed_split(transformer: torch.nn.Module) -> BlockSplit:
    """The :class:`BlockSplit` of ``transformer``, installed on its first ask and kept beside it (as
    :func:`~bcg_core.runners.build.installed_kernels` keeps the compiled kernels): a second pipeline of the same model
    shares it.

    Raises:
        ValueError: as :class:`BlockSplit`.
    """
    with _SPLITS_LOCK:
        split = _SPLITS.get(transformer)
        if split is None:
            split = _SPLITS[transformer] = BlockSplit(transformer)
        return split


def split_of(transformer: torch.nn.Module) -> BlockSplit | None:
    """The :class:`BlockSplit` installed on ``transformer``, or None (none installed yet)."""
    return _SPLITS.get(transformer)
