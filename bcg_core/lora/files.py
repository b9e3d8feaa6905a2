"""LoRA adapter files: names in ``lora.dir``, read by diffusers' own loaders into per-layer ``(A, B, scaling)``.

An adapter named ``style`` is ``<lora.dir>/style.safetensors`` or a folder ``<lora.dir>/style/`` holding
``pytorch_lora_weights.safetensors`` (what a diffusers pipeline's ``save_lora_weights`` writes). Reading one
follows ``load_lora_weights`` up to the point where peft would inject layers: the pipeline class's
``lora_state_dict`` (diffusers' own key conversion of its format and the community formats it knows: kohya,
XLabs, BFL and others for FLUX), the ``transformer.`` prefix, ``convert_unet_state_dict_to_peft`` for the
old ``lora.down``/``lora.up`` names, diffusers' ``_create_lora_config`` (rank and alpha per layer, from the
file's metadata where diffusers saved it, else from its shapes and alphas), and peft's ``get_pattern_key``
for each layer's rank and alpha, so each layer's scaling is peft's ``lora_alpha / r`` (``/ sqrt(r)`` with
rsLoRA). Nothing here keeps its own table of key names.

What bcg-serve refuses (:class:`AdapterError`, naming the file and the reason): no transformer layers, layers
of a text encoder (bcg-serve encodes text once per request, outside the batched forward), DoRA, LoKr, a bias on
``lora_B``, FLUX Control LoRA's norm layers or widened inputs, a layer that is not a linear layer of the
served transformer or not among ``lora.targets``, a shape that does not fit the layer, NaN or infinite weights,
and a rank above ``lora.max_rank``. Weights are copied out of the file (never kept as a memory map of it).
"""

from __future__ import annotations

import inspect
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from bcg_core.errors import first_line

if TYPE_CHECKING:  # imported where a file is read: the ingress lists adapter names without torch
    import torch

__all__ = ["AdapterError", "AdapterFiles", "AdapterWeights", "LayerDelta", "NAME_RE", "WEIGHT_NAME", "adapter_path",
           "holds_lora", "list_names"]

WEIGHT_NAME = "pytorch_lora_weights.safetensors"
"""The file name diffusers' ``save_lora_weights`` writes (``LORA_WEIGHT_NAME_SAFE``), looked for in a folder."""

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
"""An adapter name: letters, digits, ``_``, ``.`` and ``-``, at most 128, starting with a letter or digit (so no
path separator, no ``..`` prefix and no hidden file: a name never leaves ``lora.dir``)."""

_TEXT_PREFIXES = ("text_encoder.", "text_encoder_2.", "text_encoder_3.", "te.", "te1.", "te2.", "lora_te")


class AdapterError(ValueError):
    """An adapter that cannot be served.

    Attributes:
        name: the adapter's name.
        reason: why (names the file and what does not fit).
        unknown: True when no file of that name is served (an HTTP 422 lists the names that are).
        link: True when the name's file is a link that leads out of ``lora.dir`` (also ``unknown``: never served).
    """

    def __init__(self, name: str, reason: str, unknown: bool = False, link: bool = False):
        super().__init__(reason)
        self.name = name
        self.reason = reason
        self.unknown = unknown
        self.link = link

    def __reduce__(self):
        return (type(self), (self.name, self.reason, self.unknown, self.link))


@dataclass(frozen=True)
class LayerDelta:
    """One layer's low-rank update: ``W x + scaling * B (A x)``.

    Attributes:
        A: (rank, in_features) ``lora_A.weight``.
        B: (out_features, rank) ``lora_B.weight``.
        scaling: peft's ``lora_alpha / r`` for this layer (``lora_alpha / sqrt(r)`` with rsLoRA), before the
            request's own scale.
    """

    A: torch.Tensor
    B: torch.Tensor
    scaling: float

    @property
    def rank(self) -> int:
        """The layer's rank ``r``."""
        return self.A.shape[0]


@dataclass
class AdapterWeights:
    """An adapter read into host memory.

    Attributes:
        name: its name in ``lora.dir``.
        path: the file read.
        layers: transformer module name (``transformer_blocks.0.attn.to_q``) -> its :class:`LayerDelta`.
    """

    name: str
    path: Path
    layers: dict[str, LayerDelta]

    @property
    def rank(self) -> int:
        """The highest rank of its layers."""
        return max(d.rank for d in self.layers.values())

    @property
    def nbytes(self) -> int:
        """Bytes of its ``A`` and ``B`` tensors."""
        return sum(d.A.numel() * d.A.element_size() + d.B.numel() * d.B.element_size() for d in self.layers.values())


class AdapterFiles:
    """The adapters in one folder, read with the served pipeline's diffusers LoRA loader.

    Args:
        folder: ``lora.dir``.
        loader: the diffusers pipeline class whose ``lora_state_dict`` reads the files (the served family's,
            e.g. ``FluxPipeline``).
        layers: module name -> ``(in_features, out_features)`` of every linear layer an adapter may change
            (``lora.targets`` applied; :meth:`~bcg_core.lora.layers.LoRALayers.shapes`).
        max_rank: ``lora.max_rank``.
        max_names: most names :meth:`names` lists (a folder of thousands of files is listed in part).

    Raises:
        ValueError: ``folder`` is not a directory, or ``loader`` has no ``lora_state_dict`` (its diffusers
            pipeline has no LoRA loader).
    """

    def __init__(self, folder: str | Path, loader: type, layers: dict[str, tuple[int, int]], max_rank: int,
                 max_names: int = 1000):
        self.folder = Path(folder).resolve()
        if not self.folder.is_dir():
            raise ValueError(f"lora.dir {str(folder)!r} is not a directory")
        if not hasattr(loader, "lora_state_dict"):
            raise ValueError(f"{loader.__name__} has no LoRA loader in diffusers (no lora_state_dict); "
                             f"serve this model without lora.dir")
        self.loader = loader
        self.layers = layers
        self.max_rank = max_rank
        self.max_names = max_names

    def names(self) -> list[str]:
        """Adapter names in the folder (:func:`list_names`, at most :attr:`max_names`).

        Raises:
            OSError: the folder cannot be listed (removed, no permission).
        """
        return list_names(self.folder, self.max_names)

    def stamp(self, name: str) -> tuple:
        """``(path, mtime_ns, size)`` of adapter ``name``'s file: a file replaced or rewritten gets another stamp.

        Raises:
            AdapterError: as :meth:`path`; also a file that vanished between the lookup and the stat (unknown).
        """
        path = self.path(name)
        try:
            st = path.stat()
        except OSError:
            raise AdapterError(name, f"no adapter {name!r} in lora.dir", unknown=True) from None
        return (str(path), st.st_mtime_ns, st.st_size)

    def path(self, name: str) -> Path:
        """The file of adapter ``name`` (:func:`adapter_path`).

        Raises:
            AdapterError: see :func:`adapter_path`.
        """
        return adapter_path(self.folder, name)

    def read(self, name: str) -> AdapterWeights:
        """Read adapter ``name`` into host memory (float32 CPU tensors of every layer).

        Raises:
            AdapterError: see :meth:`path`, and the module docstring's refusals (the reason names the file).
        """
        path = self.path(name)
        where = f"adapter {name!r} ({path.relative_to(self.folder)})"  # <name>/pytorch_lora_weights.safetensors
        try:
            sd, alphas, metadata = self._state_dict(path)
        except AdapterError:
            raise
        except Exception as e:  # noqa: BLE001 - safetensors and diffusers raise many types on a bad file
            first = first_line(e, type(e).__name__)
            first = first.replace(str(path), path.name).replace(str(self.folder), "lora.dir")[:200]  # no server paths
            raise AdapterError(name, f"{where} is not a LoRA file diffusers can read (diffusers: {first})") from None
        text = sorted(k for k in sd if k.startswith(_TEXT_PREFIXES))
        if text:
            raise AdapterError(name, f"{where} changes a text encoder ({text[0]}); bcg-serve serves LoRA layers of the "
                                     f"transformer only")
        sd = {k.removeprefix("transformer."): v for k, v in sd.items() if k.startswith("transformer.")}
        if not sd:
            raise AdapterError(name, f"{where} holds no transformer layers")
        return AdapterWeights(name, path, self._layers(name, where, sd, alphas, metadata))

    def _state_dict(self, path: Path):
        """diffusers' ``lora_state_dict`` of ``path``: ``(state dict, network alphas, metadata)``."""
        kwargs = {"return_lora_metadata": True}
        params = inspect.signature(self.loader.lora_state_dict).parameters
        if "return_alphas" in params:
            kwargs["return_alphas"] = True
        out = self.loader.lora_state_dict(str(path), **kwargs)
        if "return_alphas" in kwargs:
            sd, alphas, metadata = out
        else:
            (sd, metadata), alphas = out, None
        return sd, alphas, metadata

    def _layers(self, name: str, where: str, sd: dict, alphas: dict | None, metadata: dict | None):
        """``load_lora_adapter``'s steps before peft injects layers (module docstring), then each layer's delta."""
        import torch
        from diffusers.utils import convert_unet_state_dict_to_peft
        from diffusers.utils.peft_utils import _create_lora_config
        from peft.utils.other import get_pattern_key

        for marker, what in ((".lokr_", "LoKr"), ("lora_magnitude_vector", "DoRA")):
            hit = next((k for k in sd if marker in k), None)
            if hit is not None:
                raise AdapterError(name, f"{where} holds {what} weights ({hit}); bcg-serve serves plain LoRA")
        if "lora_A" not in next(iter(sd)):
            sd = convert_unet_state_dict_to_peft(sd)
        bias = next((k for k in sd if "lora_B" in k and k.endswith(".bias")), None)
        if bias is not None:
            raise AdapterError(name, f"{where} has a bias on lora_B ({bias}); bcg-serve serves LoRA without one")
        stray = next((k for k in sd if ".lora_A." not in k and ".lora_B." not in k), None)
        if stray is not None:  # e.g. FLUX Control LoRA's norm_q/norm_k weights, or a widened x_embedder
            raise AdapterError(name, f"{where} holds a weight that is not a LoRA layer ({stray})")
        lone = next((k for k in sd if k.replace(".lora_A.", ".lora_B.") not in sd
                     or k.replace(".lora_B.", ".lora_A.") not in sd), None)
        if lone is not None:  # checked here too: diffusers' config builder fails on it with a bare IndexError
            raise AdapterError(name, f"{where}: layer {lone.split('.lora_')[0]} has only one of lora_A and lora_B")
        rank = {f"^{k}": v.shape[1] for k, v in sd.items() if "lora_B" in k and v.ndim > 1}
        if len(rank) * 2 != len(sd) or not all(rank.values()):
            raise AdapterError(name, f"{where}: a lora_B weight is not a matrix of rank 1 or more")
        if alphas:
            alphas = {k.removeprefix("transformer."): v for k, v in alphas.items() if k.startswith("transformer.")}
        if metadata:
            metadata = {k.removeprefix("transformer."): v for k, v in metadata.items()
                        if k.startswith("transformer.")} or None
        try:
            config = _create_lora_config(sd, alphas, metadata, rank, adapter_name=name)
        except Exception as e:  # noqa: BLE001 - a malformed config in the file's metadata
            raise AdapterError(name, f"{where}: its LoRA config does not load ({type(e).__name__}: "
                                     f"{first_line(e, limit=160)})") from None
        if getattr(config, "use_dora", False):
            raise AdapterError(name, f"{where} is a DoRA adapter; bcg-serve serves plain LoRA")
        if getattr(config, "lora_bias", False):
            raise AdapterError(name, f"{where} has a bias on lora_B; bcg-serve serves LoRA without one")
        layers: dict[str, LayerDelta] = {}
        for module in sorted({k.split(".lora_")[0] for k in sd}):
            a, b = sd.get(f"{module}.lora_A.weight"), sd.get(f"{module}.lora_B.weight")
            if a is None or b is None:
                raise AdapterError(name, f"{where}: layer {module} has only one of lora_A and lora_B")
            shape = self.layers.get(module)
            if shape is None:
                raise AdapterError(name, f"{where} changes layer {module}, which is not a linear layer of the served "
                                         f"transformer among lora.targets")
            r = a.shape[0]
            if a.ndim != 2 or b.ndim != 2 or b.shape[1] != r or (a.shape[1], b.shape[0]) != shape:
                raise AdapterError(name, f"{where}: layer {module} has lora_A {tuple(a.shape)} and lora_B "
                                         f"{tuple(b.shape)}; the layer takes {shape[0]} and gives {shape[1]} features")
            if r > self.max_rank:
                raise AdapterError(name, f"{where}: layer {module} has rank {r}, above lora.max_rank {self.max_rank}")
            key_r = get_pattern_key(config.rank_pattern.keys(), module)
            key_a = get_pattern_key(config.alpha_pattern.keys(), module)
            cr = config.rank_pattern.get(key_r, config.r)
            alpha = config.alpha_pattern.get(key_a, config.lora_alpha)
            scaling = alpha / math.sqrt(cr) if getattr(config, "use_rslora", False) else alpha / cr
            a32, b32 = (t.detach().to(torch.float32, copy=True).contiguous() for t in (a, b))  # copies: the
            # state dict may map the file, which can be rewritten or cut while this adapter is cached
            if not (torch.isfinite(a32).all() and torch.isfinite(b32).all()):
                raise AdapterError(name, f"{where}: layer {module} holds NaN or infinite weights")
            layers[module] = LayerDelta(a32, b32, float(scaling))
        return layers


def adapter_path(folder: Path, name: str) -> Path:
    """The file of adapter ``name`` in ``folder`` (resolved): ``<name>.safetensors``, else
    ``<name>/pytorch_lora_weights.safetensors``.

    Raises:
        AdapterError: a name that fails :data:`NAME_RE` or whose file resolves outside the folder, or no such
            file (``unknown``; an unreadable folder reads as no file).
    """
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise AdapterError(str(name)[:64], f"adapter name {str(name)[:64]!r} is not a name in lora.dir: ASCII "
                           f"letters, digits, '_', '.' and '-', at most 128, starting with a letter or digit",
                           unknown=True)
    for p in (folder / f"{name}.safetensors", folder / name / WEIGHT_NAME):
        try:
            found = p.is_file()
        except OSError:  # the folder is unreadable (permissions): as no file
            found = False
        if found:
            real = p.resolve()
            if not real.is_relative_to(folder):
                raise AdapterError(name, f"adapter {name!r} links outside lora.dir", unknown=True, link=True)
            return real
    raise AdapterError(name, f"no adapter {name!r} in lora.dir", unknown=True)


def list_names(folder: Path, limit: int) -> list[str]:
    """Adapter names in ``folder`` (resolved), sorted and unique, at most ``limit``: those :func:`adapter_path`
    finds whose file's header names a LoRA weight (:func:`holds_lora`), so a link out of the folder, a model's own
    weights or a file that is not a safetensors file are never listed (where both layouts exist, the
    ``.safetensors`` file is the one served). Names are case-sensitive and never include ``.safetensors``.

    Raises:
        OSError: the folder cannot be listed (removed, no permission).
    """
    out: list[str] = []
    # by name, not by path: "a/" and "a.safetensors" are one adapter, and "a-b.safetensors" sorts between them
    for name in sorted({p.stem if p.suffix == ".safetensors" else p.name for p in folder.iterdir()}):
        try:
            path = adapter_path(folder, name)
        except AdapterError:
            continue
        if not holds_lora(path):
            continue
        out.append(name)
        if len(out) >= limit:
            break
    return out


_HEADER_SEEN: dict[tuple[str, int, int], bool] = {}
_HEADER_SEEN_MAX = 4096


def holds_lora(path: Path) -> bool:
    """Whether safetensors file ``path``'s header names a LoRA weight: a tensor whose key holds ``lora`` in any
    case, as every format diffusers' ``lora_state_dict`` reads does (``lora_A``/``lora_B``, ``lora_down``/
    ``lora_up``, kohya's ``lora_unet_``, XLabs' ``proj_lora``; diffusers' own ``load_lora_weights`` refuses a state
    dict without such a key, its ``has_lora_keys``). Only the header is read (``safetensors.safe_open``), once per
    file version: the answer is kept by ``(path, mtime_ns, size)``.

    A file that holds one is not yet an adapter the model can serve: :meth:`AdapterFiles.read` decides that. A
    file whose header is not safetensors holds none; one that cannot be opened now (``OSError``) holds none this
    time and is asked again on the next listing.
    """
    from safetensors import safe_open

    try:
        st = path.stat()
    except OSError:
        return False
    key = (str(path), st.st_mtime_ns, st.st_size)
    found = _HEADER_SEEN.get(key)
    if found is None:
        try:
            with safe_open(str(path), "pt") as f:
                found = any("lora" in k.lower() for k in f.keys())
        except OSError:  # could not be opened now (too many open files, a file being replaced): not kept
            return False
        except Exception:  # noqa: BLE001 - safetensors raises several types on a file that is not one
            found = False
        if len(_HEADER_SEEN) >= _HEADER_SEEN_MAX:
            _HEADER_SEEN.clear()
        _HEADER_SEEN[key] = found
    return found
