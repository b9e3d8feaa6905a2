"""LoRA adapters per request, served over HTTP: the tiny default model with ``lora.dir`` holding one adapter made with
peft and saved as diffusers saves LoRA weights (``FluxPipeline.save_lora_weights``, the tiny default's
``lora_loader``) and one file that is not an adapter.

One small application of its own on the session's Serve instance (``conftest.serve_apps``: the session's apps run
without ``lora.dir``, so their forwards stay free of LoRA layers). It checks that ``GET /v1/models`` lists the
adapters, that a request with the adapter gets another image than the same request without it, that an unknown
name is 422 listing the adapters (answered by the ingress) and a file the replica cannot read is 422 naming
``lora`` (answered by the replica), that the server then still answers the plain request with the same image, and
that ``GET /v1/buckets`` counts the adapter's load. Schema, errors and metrics without Ray:
``tests/unit/test_lora_http.py``.
"""

from __future__ import annotations

import base64

import httpx
import pytest

pytestmark = pytest.mark.serve

GEN = "/v1/images/generations"
NAME, PREFIX = "bcg-lora", "/lora"


def _make_adapter(loras, name: str) -> None:
    """A random rank-4 adapter on the tiny default's attention projections, as a diffusers LoRA folder
    (``<loras>/<name>/pytorch_lora_weights.safetensors``): peft on a transformer of the tiny default's
    architecture (only its layer names and shapes matter), saved with ``FluxPipeline.save_lora_weights``."""
    import torch
    from diffusers import FluxPipeline, FluxTransformer2DModel
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    from bcg_core.families.tiny import tiny_transformer_config

    transformer = FluxTransformer2DModel(**tiny_transformer_config(384))  # all-MiniLM-L6-v2's 384 channels
    cfg = LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, target_modules=["to_q", "to_k", "to_v"])
    transformer.add_adapter(cfg, adapter_name=name)
    gen = torch.Generator().manual_seed(0)
    sd = {k: torch.randn(v.shape, generator=gen) * 0.2
          for k, v in get_peft_model_state_dict(transformer, adapter_name=name).items()}
    FluxPipeline.save_lora_weights(str(loras / name), transformer_lora_layers=sd,
                                   transformer_lora_adapter_metadata=cfg.to_dict())


@pytest.fixture(scope="module")
def lora_url(serve_apps, tmp_path_factory):
    from ray import serve

    from deployments import build_app

    loras = tmp_path_factory.mktemp("lora") / "loras"
    loras.mkdir()
    _make_adapter(loras, "style")
    (loras / "broken.safetensors").write_bytes(b"not a safetensors file")
    config = {"buckets": {"batch_sizes": [1, 2], "resolutions": ["256x256"], "text_lengths": [256],
                          "miss_policy": "eager"},
              "lora": {"dir": str(loras), "slots": 2, "max_rank": 8, "max_per_request": 2}}
    serve.run(build_app({"config": config}), name=NAME, route_prefix=PREFIX)
    try:
        yield serve_apps.base_url + PREFIX
    finally:
        serve.delete(NAME)


def test_an_adapter_changes_the_image_and_bad_names_are_422_while_the_server_serves_on(lora_url):
    body = {"prompt": "a red fox in the snow", "size": "256x256", "seed": 3, "num_inference_steps": 1}
    with httpx.Client(base_url=lora_url, timeout=300.0, trust_env=False) as client:
        card = client.get("/v1/models").json()["data"][0]["bcg"]["lora"]
        assert card["adapters"] == ["style"] and card["max_per_request"] == 2 and card["slots"] == 2

        plain = client.post(GEN, json=body)
        styled = client.post(GEN, json={**body, "lora": [{"name": "style", "scale": 1.0}]})
        assert plain.status_code == 200 and styled.status_code == 200, (plain.text, styled.text)
        image = base64.b64decode(plain.json()["data"][0]["b64_json"])
        assert plain.json()["bcg"]["lora"] is None and styled.json()["bcg"]["lora"] == [{"name": "style", "scale": 1.0}]
        assert base64.b64decode(styled.json()["data"][0]["b64_json"]) != image

        unknown = client.post(GEN, json={**body, "lora": [{"name": "nope"}]})  # the ingress's check
        assert unknown.status_code == 422, unknown.text
        err = unknown.json()["error"]
        assert err["param"] == "lora" and "no adapter 'nope' in lora.dir (adapters: style;" in err["message"]

        broken = client.post(GEN, json={**body, "lora": [{"name": "broken"}]})  # the replica's check
        assert broken.status_code == 422, broken.text
        err = broken.json()["error"]
        assert err["param"] == "lora" and "is not a LoRA file diffusers can read" in err["message"]

        again = client.post(GEN, json=body)
        assert again.status_code == 200, again.text
        assert base64.b64decode(again.json()["data"][0]["b64_json"]) == image  # slot 0 stays the base model

        stats = client.get("/v1/buckets").json()["lora"]
    assert stats["resident"] == {"style": 1}
    assert {k: stats["adapters"]["style"][k] for k in ("requests", "loads", "refused")} == {
        "requests": 1, "loads": 1, "refused": 0}
    assert stats["adapters"]["broken"]["refused"] == 1 and "nope" not in stats["adapters"]
