"""Traffic samples for the table search: what requests a table is planned for.

A :class:`Traffic` is :class:`Demand` rows (each an exact forward shape with its images, steps and weight in
requests) plus what the limits refused, by field. It comes from the packaged krea CSV (:func:`traffic_from_rows`
over :func:`krea_rows`), a GenTD26-style trace (:func:`traffic_from_gentd26`: image counts, steps and prompt
lengths, joined with krea sizes), whole requests (:func:`traffic_from_requests`) or a replica's recorded shape
histogram (:func:`traffic_from_histogram`). Every request is validated and shaped by :func:`planning_validator`,
independent of the table being planned; :func:`planning_table` is a config's own table as its replicas build it.
"""

from __future__ import annotations

import csv
import functools
import io
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from importlib import resources

from bcg_core.config import BucketConfig, EngineConfig, ModelConfig
from bcg_core.errors import RequestError
from bcg_core.families.defaults import edit_defaults
from bcg_core.keys import ShapeQuery
from bcg_core.request import GenerationRequest, steps_run
from bcg_core.table import BucketTable
from bcg_core.validation import RequestValidator

__all__ = ["GENTD26_FILLER", "KREA_CSV", "Demand", "Traffic", "krea_rows", "planning_validator", "planning_table",
           "replace_buckets", "traffic_from_gentd26", "traffic_from_histogram", "traffic_from_requests",
           "traffic_from_rows"]

KREA_CSV = "krea_open_prompts_1k_flat.csv"
"""The packaged krea request mix (``bcg_core/data/README.md``): one row per image, ``num_generations`` per request."""

GENTD26_FILLER = ("a detailed photograph of a lighthouse on a rocky coast at dusk, dramatic clouds, warm light, "
                  "high resolution, sharp focus, ")
"""Text repeated and cut to a GenTD26 row's ``prompt_length`` characters (the trace has lengths, no text), so the
model's own tokenizer counts tokens for a prompt of that length."""


@dataclass(frozen=True)
class Demand:
    """One kind of request in a traffic sample.

    Attributes:
        query: the exact shape of one denoising step's forward (rows with CFG, image tokens or grid, text tokens),
            as :meth:`~bcg_core.validation.RequestValidator.query` makes it.
        images: images per request.
        steps: denoising steps per request.
        weight: how many requests of this kind the sample holds (fractions allowed: a krea row is 1/n).
        size: the requested ``(width, height)`` in pixels.
    """

    query: ShapeQuery
    images: int
    steps: int
    weight: float
    size: tuple[int, int]


@dataclass
class Traffic:
    """A traffic sample: :class:`Demand` rows, what was refused (the limits' reason per row) and its source."""

    demands: list[Demand]
    source: str
    refused: dict[str, float] = field(default_factory=dict)

    @property
    def requests(self) -> float:
        """Requests in the sample (the weights' sum)."""
        return sum(d.weight for d in self.demands)

    def merged(self) -> Traffic:
        """The same sample with equal rows (query, images, steps, size) summed into one."""
        out: dict[tuple, Demand] = {}
        for d in self.demands:
            k = (d.query, d.images, d.steps, d.size)
            out[k] = replace(d, weight=out[k].weight + d.weight) if k in out else d
        return Traffic(list(out.values()), self.source, dict(self.refused))


def planning_validator(config: EngineConfig) -> RequestValidator:
    """A :class:`~bcg_core.validation.RequestValidator` of ``config``'s model and limits whose table holds every valid
    prompt (text bucket: the native length, else the family's encoder limit) and never rejects a miss: traffic is
    validated and shaped with it, independent of the table being planned.

    Raises:
        ValueError: the configured checkpoint cannot be described (naming it).
    """
    from bcg_core.families.defaults import family_buckets

    spec, counter = _spec_and_counter(config.model)
    config = family_buckets(config, spec)  # a video family's frames where the config sets no buckets
    native = spec.rules.native_text_tokens
    text = native if native is not None else (spec.max_text_tokens or max(config.buckets.text_lengths))
    wide = replace_buckets(config, text_lengths=[text], miss_policy="eager")
    return RequestValidator(wide, spec, counter)


def planning_table(config: EngineConfig) -> BucketTable:
    """``config``'s own bucket table, as its replicas build it (to score the current table against a plan)."""
    return RequestValidator(config, *_spec_and_counter(config.model)).table


@functools.lru_cache(maxsize=8)
def _spec_and_counter(model: ModelConfig):
    """The model's spec and token counter (JSON configs and tokenizer only), read once per model: planning and
    each drift check build several validators of one model."""
    from bcg_core.models import describe_model, load_tokenizer_counter

    return describe_model(model), load_tokenizer_counter(model)


def replace_buckets(config: EngineConfig, **fields) -> EngineConfig:
    """``config`` with ``buckets`` fields replaced (validated again)."""
    return config.model_copy(update={"buckets": BucketConfig(**{**config.buckets.model_dump(), **fields})})


def krea_rows(path: str | None = None) -> list[dict[str, str]]:
    """Rows of the krea CSV: the packaged one (:data:`KREA_CSV`) or ``path``, as strings.

    Raises:
        ValueError: ``path`` is missing, a folder, not UTF-8 text, or has no ``width`` and ``height`` columns
            (each naming the file).
    """
    if path is None:
        text = resources.files("bcg_core").joinpath("data", KREA_CSV).read_text(encoding="utf-8")
    else:
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except FileNotFoundError:
            raise ValueError(f"{path}: no such file (a krea-format CSV)") from None
        except IsADirectoryError:
            raise ValueError(f"{path} is a folder, not a krea-format CSV") from None
        except UnicodeDecodeError:
            raise ValueError(f"{path} is not a krea-format CSV: not UTF-8 text") from None
    reader = csv.DictReader(io.StringIO(text))
    missing = [c for c in ("width", "height") if c not in (reader.fieldnames or [])]
    if missing:
        raise ValueError(f"{path or KREA_CSV} is not a krea-format CSV: its header {reader.fieldnames or []} lacks "
                         f"{missing}; give a CSV with the columns prompt, width, height, num_generations, num_step")
    return list(reader)


def _int(row: Mapping[str, str], name: str) -> int | None:
    v = (row.get(name) or "").strip()
    return int(float(v)) if v else None


def _float(row: Mapping[str, str], name: str) -> float | None:
    v = (row.get(name) or "").strip()
    return float(v) if v else None


def _demand(validator: RequestValidator, request: GenerationRequest, weight: float, text_tokens: int | None,
            refused: dict[str, float]) -> Demand | None:
    """``request`` validated (defaults filled, shaped); refusals counted by the field the limits name."""
    try:
        validated = validator.validate(request)
    except RequestError as e:
        refused[e.field] = refused.get(e.field, 0.0) + weight
        return None
    query = validated.lookup.query
    if text_tokens is not None and validator.rules.native_text_tokens is None:
        query = validator.query(validated.request, text_tokens)
    r = validated.request
    return Demand(query, r.n, validated.steps_run, weight, (r.width, r.height))


def traffic_from_rows(config: EngineConfig, rows: Iterable[Mapping[str, str]], source: str = "krea",
                      steps: int | None = None) -> Traffic:
    """Traffic from krea-format rows (``prompt``, ``width``, ``height``, ``num_generations``, ``num_step``,
    ``cfg_scale``): one row per image, so each weighs ``1 / num_generations`` of a request.

    Args:
        config: the model and limits (requests outside them are refused and counted, not planned).
        rows: the CSV rows (:func:`krea_rows`).
        source: the sample's name in the plan.
        steps: every request's steps instead of the row's ``num_step`` (krea's are SD 1.x steps).

    Raises:
        ValueError: a row without width or height, naming it.
    """
    validator = planning_validator(config)
    demands, refused = [], {}
    for i, row in enumerate(rows):
        w, h = _int(row, "width"), _int(row, "height")
        if w is None or h is None:
            raise ValueError(f"{source} row {i}: width and height are required")
        n = _int(row, "num_generations") or 1
        cfg = _float(row, "cfg_scale")
        prompt = (row.get("prompt") or "").strip() or "x"
        req = GenerationRequest(prompt, n=n, width=w, height=h, seed=0,
                                num_inference_steps=steps if steps is not None else _int(row, "num_step"),
                                guidance_scale=None if cfg is None else min(cfg, config.limits.max_guidance_scale))
        d = _demand(validator, req, 1.0 / n, None, refused)
        if d is not None:
            demands.append(d)
    return Traffic(demands, source, refused).merged()


def traffic_from_requests(config: EngineConfig, requests: Iterable[GenerationRequest],
                          source: str = "requests") -> Traffic:
    """Traffic of whole requests (each weighs one), e.g. the ones a replay sends; refusals counted by field."""
    validator = planning_validator(config)
    demands, refused = [], {}
    for r in requests:
        d = _demand(validator, r, 1.0, None, refused)
        if d is not None:
            demands.append(d)
    return Traffic(demands, source, refused).merged()


def traffic_from_gentd26(config: EngineConfig, rows: Iterable[Mapping[str, str]],
                         sizes: Sequence[tuple[int, int]], steps: int | None = None) -> Traffic:
    """Traffic from a GenTD26-style trace (``num_images_per_prompt``, ``num_inference_steps``, ``prompt_length``
    in characters, ``predict_type``). The trace has no sizes: row ``i`` takes ``sizes[i % len(sizes)]`` (e.g. the
    krea requests' sizes in file order); its prompt is :data:`GENTD26_FILLER` cut to ``prompt_length`` characters,
    counted by the model's tokenizer. ``IMG_2_IMG`` and ``INPAINTING`` rows are edits: the trace has no strength,
    so each runs the share of its steps that its edit pipeline's default strength runs
    (:func:`~bcg_core.families.defaults.edit_defaults`, :func:`~bcg_core.request.steps_run`: 18 of 30 at 0.6);
    for a family without edits they are refused (counted under ``image``). Other types are skipped.

    Raises:
        ValueError: ``sizes`` is empty.
    """
    if not sizes:
        raise ValueError("traffic_from_gentd26 needs at least one (width, height) size to join the trace with")
    validator = planning_validator(config)
    demands, refused = [], {}
    i = 0
    for row in rows:
        kind = (row.get("predict_type") or "TXT_2_IMG").strip()
        if kind not in ("TXT_2_IMG", "IMG_2_IMG", "INPAINTING"):
            continue
        strength = None
        if kind != "TXT_2_IMG":
            if validator.spec.edit_pipelines is None:
                refused["image"] = refused.get("image", 0.0) + 1.0
                continue
            strength = edit_defaults(validator.spec, validator.limits, kind == "INPAINTING")["strength"]
        n = _int(row, "num_images_per_prompt") or 1
        chars = max(1, _int(row, "prompt_length") or 1)
        prompt = (GENTD26_FILLER * (chars // len(GENTD26_FILLER) + 1))[:chars].strip() or "x"
        w, h = sizes[i % len(sizes)]
        i += 1
        count = steps if steps is not None else _int(row, "num_inference_steps")
        if count is None and strength is not None:  # an edit row without steps: its edit pipeline's default
            count = edit_defaults(validator.spec, validator.limits, kind == "INPAINTING")["steps"]
        req = GenerationRequest(prompt, n=n, width=w, height=h, seed=0, num_inference_steps=count)
        d = _demand(validator, req, 1.0, None, refused)  # an edit's forwards are its text-to-image twin's
        if d is not None:
            demands.append(d if strength is None else replace(d, steps=steps_run(d.steps, strength)))
    return Traffic(demands, "gentd26", refused).merged()


def traffic_from_histogram(config: EngineConfig, snapshot: Mapping) -> Traffic:
    """Traffic from a replica's recorded shape histogram (:meth:`~bcg_core.planning.traffic.TrafficHistogram.snapshot`):
    each shape weighs its count; its ``cfg_count`` requests run with classifier-free guidance (where the family
    adds uncond rows for it), the rest without.

    Raises:
        ValueError: a snapshot that does not validate (:meth:`TrafficHistogram.from_snapshot`).
    """
    from bcg_core.planning.traffic import TrafficHistogram

    hist = TrafficHistogram.from_snapshot(dict(snapshot))
    validator = planning_validator(config)
    spec = validator.spec
    demands, refused = [], {}
    for s in hist.snapshot()["shapes"]:
        cfg_count = int(s.get("cfg_count") or 0)
        for cfg, count in ((True, cfg_count), (False, int(s["count"]) - cfg_count)):
            if count <= 0:
                continue
            if cfg and spec.cfg_rule == "none":
                continue  # recorded by a replica of another config; this model never runs CFG
            extra = spec.cfg_fields(cfg, min(config.limits.max_guidance_scale,
                                             max(4.5, validator.default_guidance_scale or 0.0)))
            req = GenerationRequest("x", n=int(s["n"]), width=int(s["width"]), height=int(s["height"]), seed=0,
                                    num_inference_steps=int(s["steps"]), **extra)
            d = _demand(validator, req, float(count), int(s["text_tokens"]), refused)
            if d is not None:
                demands.append(d)
    return Traffic(demands, "histogram", refused).merged()
