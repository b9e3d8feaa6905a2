"""Checkpoint loading: family detection from ``model_index.json``, checkpoint checks, saving.

A checkpoint folder has the layout diffusers' ``save_pretrained`` writes: ``model_index.json`` naming the
pipeline class (``_class_name``) and one sub-folder per component. The class picks the family
(:data:`bcg_core.families.PIPELINE_CLASSES`); the family loads the folder (:meth:`Family.load`).

:func:`read_checkpoint` checks a folder before anything is loaded, so that a bad checkpoint is a start-up error
naming the cause and the fix, never a hung replica: a missing folder or ``model_index.json``, an unknown
``_class_name``, a component folder that is missing or whose config names another class than the index.

``model.path`` unset serves the tiny default (:mod:`bcg_core.families.tiny`).
"""

from __future__ import annotations

import json
import weakref
from pathlib import Path
from typing import TYPE_CHECKING

from bcg_core.config import ModelConfig
from bcg_core.families import PIPELINE_CLASSES, ModelSpec, family_class
from bcg_core.families.helpers import tokenizer_counter

if TYPE_CHECKING:
    from bcg_core.families import Family

__all__ = [
    "ACTIVATION_FACTOR",
    "CheckpointError",
    "ModelSpec",
    "estimate_graph_bytes",
    "transformer_width",
    "describe_model",
    "load_model",
    "load_seconds",
    "load_tokenizer_counter",
    "read_checkpoint",
    "save_pipeline",
    "weights_stamp",
]

class CheckpointError(ValueError):
    """A checkpoint folder that cannot be served; the message names the cause and the fix."""



_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "vocab.txt", "spiece.model",
                    "tokenizer.model")
"""Files of which a saved tokenizer folder holds at least one (``PreTrainedTokenizer.save_pretrained``)."""

_WEIGHT_SUFFIXES = (".safetensors", ".bin")
"""Weight files of a saved model folder (``ModelMixin``/``PreTrainedModel.save_pretrained``), sharded or not."""


def _check_component(path: Path, component: str, library: str, cls: str) -> None:
    """Raise :class:`CheckpointError` unless ``path / component`` holds what ``save_pretrained`` writes for a
    ``cls`` of ``library``: a tokenizer's (or a processor's, which holds its tokenizer's) files; a scheduler's config;
    a model's config and weights."""
    folder = path / component
    where = f"checkpoint {str(path)!r}: component {component!r} ({cls})"
    fix = "copy the whole folder that pipeline.save_pretrained wrote"
    if not folder.is_dir():
        raise CheckpointError(f"{where} is listed in model_index.json but {folder} is missing; {fix}")
    if "Tokenizer" in cls or cls.endswith("Processor"):  # FLUX.2 [dev]: a PixtralProcessor wraps its tokenizer
        if not any((folder / f).is_file() for f in _TOKENIZER_FILES):
            raise CheckpointError(f"{where}: {folder} holds no tokenizer files (none of "
                                  f"{', '.join(_TOKENIZER_FILES)}); a tokenizer loaded from it would be empty; {fix}")
        return
    if "Scheduler" in cls:
        if not (folder / "scheduler_config.json").is_file():
            raise CheckpointError(f"{where}: {folder / 'scheduler_config.json'} is missing; {fix}")
        return
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{where}: {config_file} is missing; {fix}")
    try:
        named = json.loads(config_file.read_text()).get("_class_name")
    except (json.JSONDecodeError, AttributeError):
        raise CheckpointError(f"{where}: {config_file} is not a JSON object; {fix}") from None
    if library == "diffusers" and named is not None and named != cls:
        raise CheckpointError(f"{where}: {config_file} names class {named}, but model_index.json says {cls}; the "
                              f"folder mixes components of different pipelines; {fix}")
    if not any(f.suffix in _WEIGHT_SUFFIXES for f in folder.iterdir()):
        raise CheckpointError(f"{where}: {folder} holds no weights (*.safetensors or *.bin); {fix}")


def read_checkpoint(path: str | Path) -> dict:
    """``model_index.json`` of a checkpoint folder, after checking the folder can be served.

    Raises:
        CheckpointError: the folder or its ``model_index.json`` is missing or not a JSON object; ``_class_name``
            is missing or names no supported pipeline (the message lists the supported ones); a component listed
            in the index has no folder, no tokenizer files, no config, no weights, or a config that names another
            class than the index says.
    """
    path = Path(path)
    if path.is_file():
        raise CheckpointError(f"model.path {str(path)!r} is a file: single-file checkpoints are not read; point "
                              f"model.path at a diffusers checkpoint folder (the output of pipeline.save_pretrained, "
                              f"with model_index.json)")
    if not path.is_dir():
        raise CheckpointError(f"model.path {str(path)!r} does not exist or is not a folder; point model.path at a "
                              f"diffusers checkpoint folder (the output of pipeline.save_pretrained)")
    index_file = path / "model_index.json"
    if not index_file.is_file():
        raise CheckpointError(
            f"model.path {str(path)!r} is not a diffusers checkpoint folder: {index_file} is missing "
            f"(expected model_index.json, transformer/, vae/, scheduler/ and text encoder folders)"
            + (f"; {str(path.parent)!r} has one: point model.path there" if (path.parent / "model_index.json").is_file()
               else ""))
    try:
        index = json.loads(index_file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{index_file} is not valid JSON ({e}); re-save the pipeline with "
                              f"save_pretrained") from None
    if not isinstance(index, dict):
        raise CheckpointError(f"{index_file} holds a JSON {type(index).__name__}, not an object naming the pipeline "
                              f"class and its components; re-save the pipeline with save_pretrained")
    supported = ", ".join(sorted(PIPELINE_CLASSES))
    cls = index.get("_class_name")
    if not cls:
        raise CheckpointError(f"{index_file} has no _class_name (the diffusers pipeline class); supported: {supported}")
    if cls not in PIPELINE_CLASSES:
        raise CheckpointError(
            f"model.path {str(path)!r} holds a {cls} checkpoint (model_index.json _class_name); supported: {supported}")
    for component, entry in index.items():
        if component.startswith("_") or not isinstance(entry, list) or len(entry) != 2 or entry[1] is None:
            continue
        _check_component(path, component, str(entry[0]), str(entry[1]))
    return index


def describe_model(config: ModelConfig) -> ModelSpec:
    """Name, family, shape and request rules of the configured model, from JSON configs only (no weights).

    Raises:
        CheckpointError: if ``config.path`` is not a servable checkpoint folder.
    """
    if config.path is None:
        from bcg_core.families.tiny_spec import tiny_spec

        return tiny_spec()
    path = Path(config.path)
    index = read_checkpoint(path)
    return family_class(index["_class_name"]).describe(path, index)


def load_tokenizer_counter(config: ModelConfig):
    """A function ``(prompt, negative=False) -> token count`` of the key's text dimension (tokenizers only).

    The ingress uses it to validate prompt length and compute the text dimension of a bucket key without
    loading any model weights.
    """
    if config.path is None:
        from transformers import AutoTokenizer

        from bcg_core.text import minilm_path

        return tokenizer_counter(AutoTokenizer.from_pretrained(str(minilm_path()), local_files_only=True))
    path = Path(config.path)
    index = read_checkpoint(path)
    return family_class(index["_class_name"]).token_counter(path, index)


_LOAD_S: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""Seconds :func:`load_model` took, per family object it returned (kept beside the object, never on it)."""


def load_seconds(model: Family) -> float | None:
    """Seconds :func:`load_model` took to load ``model`` (``/v1/buckets`` ``model.load_s``: with
    ``kernels.prepare_s``, the replica's start); None for a family built otherwise (``build_tiny``)."""
    return _LOAD_S.get(model)


def load_model(config: ModelConfig) -> Family:
    """Load the configured model: the tiny default when ``config.path`` is None, else a local checkpoint. The
    seconds it took are kept beside it (:func:`load_seconds`).

    Raises:
        CheckpointError: if ``config.path`` is not a servable checkpoint folder.
    """
    import time

    from bcg_core.devices import resolve_device, torch_dtype

    t0 = time.perf_counter()
    if config.path is None:
        from bcg_core.families.tiny import build_tiny

        model = build_tiny(config)
    else:
        path = Path(config.path)
        index = read_checkpoint(path)
        model = family_class(index["_class_name"]).load(path, index, resolve_device(config.device),
                                                        torch_dtype(config.dtype))
    _LOAD_S[model] = time.perf_counter() - t0
    return model


def save_pipeline(model: Family, path: str | Path) -> Path:
    """Write a tiny-layout model (``BCGFluxPipeline``) as a checkpoint folder that :func:`load_model` reads back.

    Returns:
        The folder written.

    Raises:
        TypeError: if the model is not of the tiny layout (its text encoder is not a sentence encoder).
    """
    from bcg_core.families.tiny import BCGFluxFamily
    from bcg_core.text import SentenceTextEncoder

    text = model.text_encoder if isinstance(model, BCGFluxFamily) else None
    if not isinstance(text, SentenceTextEncoder):
        raise TypeError("save_pipeline writes the BCGFluxPipeline layout, which needs a SentenceTextEncoder; "
                        "diffusers pipelines are saved with their own save_pretrained")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.adapter.model.save_pretrained(path / "transformer")
    model.vae.save_pretrained(path / "vae")
    model.scheduler.save_pretrained(path / "scheduler")
    text.model.save_pretrained(path / "text_encoder")
    text.tokenizer.save_pretrained(path / "tokenizer")
    index = {
        "_class_name": "BCGFluxPipeline",
        "_diffusers_version": __import__("diffusers").__version__,
        "bcg_text_tokens": model.rules.native_text_tokens,
        "scheduler": ["diffusers", type(model.scheduler).__name__],
        "text_encoder": ["transformers", type(text.model).__name__],
        "tokenizer": ["transformers", type(text.tokenizer).__name__],
        "transformer": ["diffusers", type(model.adapter.model).__name__],
        "vae": ["diffusers", type(model.vae).__name__],
    }
    (path / "model_index.json").write_text(json.dumps(index, indent=2))
    return path


ACTIVATION_FACTOR = 38.0
"""Graph pool bytes per ``token x hidden x dtype byte`` of a bucket's forward. Measured on an H200
(docs/bench/2026-11-30_flux-dev_h200.json): FLUX.1-dev's largest bucket b8_i4096_t512 (36,864 tokens,
hidden 3,072, bf16) grew the pool by 8,366 MiB = 38.7 x 36,864 x 3,072 x 2 bytes."""


def estimate_graph_bytes(key, hidden_size: int, dtype_bytes: int, factor: float = ACTIVATION_FACTOR) -> int:
    """Estimated graph pool bytes of bucket ``key`` (a :class:`~bcg_core.table.BucketKey`) before it is captured.

    ``factor * key.tokens * hidden_size * dtype_bytes`` (see :data:`ACTIVATION_FACTOR` for the measurement
    behind the factor). Used to place buckets within replica budgets and by the bucket planner; the capture
    then measures the real bytes (``/v1/buckets`` ``pool_bytes``).
    """
    return int(factor * key.tokens * hidden_size * dtype_bytes)


def transformer_width(model_path: str | None) -> int:
    """Transformer width (the channels of each token of its stream) of the checkpoint at ``model_path`` (the tiny
    default's when None), asked of its family (:meth:`~bcg_core.families.Family.transformer_width`), which reads the
    keys its transformer class takes from ``transformer/config.json`` (``num_attention_heads * attention_head_dim``
    for most; Z-Image's ``dim``).

    Raises:
        CheckpointError: ``model_path`` is not a servable checkpoint folder (:func:`read_checkpoint`), or its
            transformer config lacks a key its family reads (naming the key and the file).
    """
    from bcg_core.families.helpers import heads_width, read_json
    from bcg_core.families.tiny_spec import tiny_transformer_config

    if model_path is None:  # BCGFluxFamily's width: FLUX's heads x head channels
        return heads_width(tiny_transformer_config(384))
    path = Path(model_path)
    index = read_checkpoint(path)
    family = family_class(index["_class_name"])
    config_file = path / "transformer" / "config.json"
    try:
        return int(family.transformer_width(read_json(config_file)))
    except KeyError as e:
        raise CheckpointError(f"{config_file} has no {e}, which {index['_class_name']} (family {family.name}) reads "
                              f"its transformer's width from; copy the whole folder that pipeline.save_pretrained "
                              f"wrote") from None


def weights_stamp(path: str | Path | None, component: str = "transformer") -> str | None:
    """16 hex digits that change when a file of the checkpoint's ``transformer/`` folder (its weights and config; or
    of ``component``'s, e.g. Wan 2.2's second expert ``transformer_2``) is replaced, rewritten or renamed: a hash of
    each file's relative path, size and modification time (no weight is read). None for the embedded tiny default
    (``path`` None) or a folder without that component.

    What it keys: measurements of the weights' values kept across restarts (:func:`bcg_core.verify.
    derived_tolerance`). A file rewritten with the same size and a restored modification time (``rsync
    -t`` of other weights of the same shapes) keeps its stamp: delete the compile cache folder after such a copy.
    """
    import hashlib
    import os

    if path is None or not (folder := Path(path) / component).is_dir():
        return None
    seen = []
    for root, _, names in os.walk(folder, followlinks=True):
        for name in names:
            try:
                st = os.stat(os.path.join(root, name))
            except FileNotFoundError:  # removed while listed
                continue
            seen.append((os.path.relpath(os.path.join(root, name), folder), st.st_size, st.st_mtime_ns))
    return hashlib.sha256(repr(sorted(seen)).encode()).hexdigest()[:16]
