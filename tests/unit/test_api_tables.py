"""docs/API.md's family tables repeat the code: the quality table :data:`bcg_core.families.base.QUALITY_STEPS` (whose
docstring says so), the defaults table each diffusers pipeline's ``__call__`` defaults
(:func:`bcg_core.families.defaults.pipeline_defaults`), one row per family, the families added last included."""

from __future__ import annotations

import re
from pathlib import Path

from bcg_core.families.base import QUALITY_STEPS

API = Path(__file__).resolve().parents[2] / "docs" / "API.md"

QUALITY_ROWS = {  # QUALITY_STEPS key -> the family cell of its row
    "bcg-tiny": "tiny default (`BCGFluxPipeline`)",
    "flux-dev": "FLUX.1-dev (`FluxPipeline`, guidance embedding)",
    "flux-schnell": "FLUX.1-schnell (`FluxPipeline`, no guidance embedding)",
    "sd3": "SD3 (`StableDiffusion3Pipeline`)",
    "pixart": "PixArt-Sigma (`PixArtSigmaPipeline`)",
    "sana": "SANA (`SanaPipeline`)",
    "qwenimage": "Qwen-Image (`QwenImagePipeline`)",
    "flux2": "FLUX.2 [dev] and [klein] base (`Flux2Pipeline`, `Flux2KleinPipeline`)",
    "flux2-distilled": "FLUX.2 [klein] distilled (`Flux2KleinPipeline`, `is_distilled`)",
    "zimage": "Z-Image (`ZImagePipeline`)",
    "qwenimage21": "Qwen-Image 2.1 (`QwenImage21Pipeline`)",
    "wan": "Wan 2.1, Wan 2.2 A14B (`WanPipeline`, video)",
}


def _table(heading: str) -> list[list[str]]:
    """The cells of the body rows of the first table under ``### heading``."""
    section = API.read_text().split(f"\n### {heading}\n", 1)[1].split("\n### ", 1)[0]
    lines = [line for line in section.splitlines() if line.startswith("|")]
    return [[c.strip() for c in line.strip("|").split(" | ")] for line in lines[2:]]


def test_the_quality_table_repeats_quality_steps_for_every_family():
    rows = {r[0]: tuple(int(c) for c in r[1:4]) for r in _table("Quality")}
    assert set(QUALITY_ROWS) == set(QUALITY_STEPS), "a QUALITY_STEPS entry without its row here"
    for key, label in QUALITY_ROWS.items():
        assert rows.get(label) == QUALITY_STEPS[key], (key, label, rows.get(label))
    assert len(rows) == len(QUALITY_ROWS)


def test_the_defaults_table_repeats_each_pipelines_call_defaults():
    from bcg_core.families import PIPELINE_CLASSES
    from bcg_core.families.defaults import pipeline_defaults

    rows = _table("Defaults and reproducing an image in diffusers")
    named = set()
    for family, steps, guidance, true_cfg, size in rows:
        cls = re.search(r"`(\w+Pipeline)`", family).group(1)
        named.add(cls)
        if cls == "BCGFluxPipeline":  # the tiny default: no diffusers pipeline
            continue
        d = pipeline_defaults(cls)
        assert int(steps.split()[0]) == d["default_steps"], family
        g = d["default_guidance_scale"]
        assert guidance.split()[0] == ("none" if g is None else f"{g:.1f}"), family
        t = d["default_true_cfg_scale"]
        assert true_cfg.split()[0] == ("-" if t is None else f"{t:.1f}"), family
        assert re.search(r"\d+x\d+|sample_size", size), family
    assert named == set(PIPELINE_CLASSES), f"pipelines without a row: {set(PIPELINE_CLASSES) - named}"
