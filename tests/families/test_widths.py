"""The transformer width behind every graph-memory estimate (``bcg_core.models.transformer_width``: the shape-aware
router's bucket ownership, ``bcg plan``'s token-count costs) is asked of the checkpoint's family, which reads the keys
its transformer class takes: every family's tiny checkpoint (``tests/tiny/``) against the width of the transformer its
config builds (the input width of its final projection), Z-Image's ``dim`` / ``n_heads`` config included; and
``bcg plan`` and the router's demands on a Z-Image config, which failed on ``KeyError: 'num_attention_heads'``.
"""

from __future__ import annotations

import json

import diffusers
import pytest
import torch

from bcg_core.models import CheckpointError, transformer_width
from tiny import flux, flux2, pixart, qwenimage, qwenimage21, sana, sd3, wan, zimage

BUILDERS = {
    "flux": flux.build, "sd3": sd3.build, "pixart": pixart.build, "sana": sana.build, "qwenimage": qwenimage.build,
    "flux2-dev": flux2.build, "flux2-klein": lambda d: flux2.build(d, "klein"), "zimage": zimage.build,
    "qwenimage21": qwenimage21.build, "wan": wan.build,
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("widths")
    with qwenimage21.loadable():
        return {name: build(root / name) for name, build in BUILDERS.items()}


def _built_width(cfg: dict) -> int:
    """The width of the transformer ``cfg`` builds (on the meta device): its final projection's input."""
    with torch.device("meta"):
        model = getattr(diffusers, cfg["_class_name"]).from_config(cfg)
    final = model.all_final_layer["2-1"].linear if cfg["_class_name"] == "ZImageTransformer2DModel" else model.proj_out
    return final.in_features


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_each_familys_width_is_its_transformers(name, folders):
    cfg = json.loads((folders[name] / "transformer" / "config.json").read_text())
    assert transformer_width(str(folders[name])) == _built_width(cfg) > 0


def test_the_tiny_defaults_width():
    from bcg_core.families.tiny import tiny_transformer_config

    assert transformer_width(None) == _built_width({"_class_name": "FluxTransformer2DModel",
                                                    **tiny_transformer_config(384)})


def test_a_config_without_the_key_its_family_reads_is_a_checkpoint_error(folders, tmp_path):
    import shutil

    folder = shutil.copytree(folders["zimage"], tmp_path / "zimage")
    cfg_file = folder / "transformer" / "config.json"
    cfg = json.loads(cfg_file.read_text())
    del cfg["dim"]
    cfg_file.write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"has no 'dim', which ZImagePipeline \(family zimage\) reads"):
        transformer_width(str(folder))


def test_bcg_plan_and_the_routers_demands_work_on_a_zimage_config(folders, tmp_path, capsys):
    from deployments.cli.main import main
    from deployments.settings import load_config
    from router.ownership import demands_for_config

    config = tmp_path / "zimage.yaml"
    config.write_text(f"model: {{path: {folders['zimage']}, device: cpu}}\nlimits: {{min_side_px: 32}}\n"
                      "buckets: {batch_sizes: [1, 2], resolutions: ['32x32', '64x64'], text_lengths: [32, 64]}\n")
    krea = tmp_path / "krea.csv"
    krea.write_text("prompt,width,height,num_step,num_generations\na red cube,64,64,4,1\na cat,32,32,4,2\n"
                    "a lighthouse at dusk,64,64,4,1\n")
    demands = demands_for_config(load_config(config_path=str(config)))
    width = transformer_width(str(folders["zimage"]))
    assert demands and all(d.graph_bytes > 0 for d in demands.values()) and width == 32
    assert main(["plan", "--config", str(config), "--krea", str(krea), "--max-graphs", "2"]) in (0, 1)
    captured = capsys.readouterr()
    assert "chosen:" in captured.out and "Traceback" not in captured.err and "error" not in captured.err
