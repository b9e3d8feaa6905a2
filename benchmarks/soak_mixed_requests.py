"""The mixed soak's requests (``benchmarks/soak_mixed.py``): the mix of kinds and the bad requests, the LoRA
adapters made offline, the noise images and masks uploaded, one request built per kind, and one request sent with
its outcome counted.

Imported by ``soak_mixed.py``, which puts the repository on ``sys.path`` first (:func:`make_adapters` imports
``bcg_core``).
"""

from __future__ import annotations

import asyncio
import io
import random
from pathlib import Path

MIX = {"generate": 0.25, "stream": 0.15, "lora1": 0.15, "lora2": 0.10, "img2img": 0.125, "inpaint": 0.125,
       "bad": 0.10}
"""Share of each request kind (sums to 1): the issue's mix, 10% bad requests."""

BAD_KINDS = ("size", "adapter", "n", "json", "not_image", "mask_size")
"""The bad requests, sent in turn: each must be answered 4xx (422, or 400 for a body that is not JSON)."""

ADAPTERS = ("style", "ink")


def make_adapters(folder: Path) -> Path:
    """Two random rank-4 adapters (:data:`ADAPTERS`) of the tiny default, saved as diffusers saves LoRA weights
    (``<folder>/loras/<name>/pytorch_lora_weights.safetensors``), made with peft as
    ``tests/serve/test_lora_serve.py`` makes them; returns the ``loras`` folder."""
    import torch
    from diffusers import FluxPipeline, FluxTransformer2DModel
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    from bcg_core.families.tiny import tiny_transformer_config

    loras = folder / "loras"
    loras.mkdir(parents=True, exist_ok=True)
    for seed, name in enumerate(ADAPTERS):
        transformer = FluxTransformer2DModel(**tiny_transformer_config(384))  # all-MiniLM-L6-v2's 384 channels
        cfg = LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, target_modules=["to_q", "to_k", "to_v"])
        transformer.add_adapter(cfg, adapter_name=name)
        gen = torch.Generator().manual_seed(seed)
        sd = {k: torch.randn(v.shape, generator=gen) * 0.2
              for k, v in get_peft_model_state_dict(transformer, adapter_name=name).items()}
        FluxPipeline.save_lora_weights(str(loras / name), transformer_lora_layers=sd,
                                       transformer_lora_adapter_metadata=cfg.to_dict())
    return loras


def noise_png(width: int, height: int, rng: random.Random) -> bytes:
    """An RGB PNG of ``width`` x ``height`` pixels: coarse random blocks (8 px), so it encodes small but differs
    per call."""
    from PIL import Image

    small = Image.frombytes("RGB", (max(1, width // 8), max(1, height // 8)),
                            rng.randbytes(3 * max(1, width // 8) * max(1, height // 8)))
    buf = io.BytesIO()
    small.resize((width, height), Image.NEAREST).save(buf, format="PNG")
    return buf.getvalue()


def mask_png(width: int, height: int) -> bytes:
    """OpenAI's mask convention: opaque keeps, fully transparent (the left half) is edited."""
    from PIL import Image

    im = Image.new("RGBA", (width, height), (0, 0, 0, 255))
    im.paste((0, 0, 0, 0), (0, 0, width // 2, height))
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    return buf.getvalue()


def build_request(kind: str, row, steps: int, rng: random.Random, bad_index: int) -> dict:
    """One request of ``kind``: ``{"kind", "path", "json" | "files"+"data" | "content", "stream", "n"}``."""
    size = f"{row.width}x{row.height}"
    base = {"prompt": row.prompt, "num_inference_steps": steps, "seed": rng.randrange(2**31)}
    if kind in ("generate", "stream", "lora1", "lora2"):
        body = {**base, "size": size, "n": row.n}
        if kind == "stream":
            body.update(stream=True, partial_images=rng.choice((1, 2)))
        elif kind == "lora1":
            body["lora"] = [{"name": rng.choice(ADAPTERS), "scale": round(rng.uniform(0.3, 1.2), 2)}]
        elif kind == "lora2":
            body["lora"] = [{"name": n, "scale": round(rng.uniform(0.3, 1.0), 2)} for n in ADAPTERS]
        return {"kind": kind, "path": "/v1/images/generations", "json": body, "stream": kind == "stream",
                "n": row.n}
    if kind in ("img2img", "inpaint"):
        n = min(row.n, 2)
        files = {"image": ("photo.png", noise_png(row.width, row.height, rng), "image/png")}
        if kind == "inpaint":
            files["mask"] = ("mask.png", mask_png(row.width, row.height), "image/png")
        data = {k: str(v) for k, v in base.items()}
        data.update(n=str(n), strength=str(round(rng.uniform(0.5, 1.0), 2)))
        return {"kind": kind, "path": "/v1/images/edits", "files": files, "data": data, "stream": False, "n": n}
    bad = BAD_KINDS[bad_index % len(BAD_KINDS)]
    gen = "/v1/images/generations"
    if bad == "size":
        return {"kind": "bad", "bad": bad, "path": gen, "json": {**base, "size": "500x500"}}
    if bad == "adapter":
        return {"kind": "bad", "bad": bad, "path": gen, "json": {**base, "size": size, "lora": [{"name": "nope"}]}}
    if bad == "n":
        return {"kind": "bad", "bad": bad, "path": gen, "json": {**base, "size": size, "n": 1000}}
    if bad == "json":
        return {"kind": "bad", "bad": bad, "path": gen, "content": b'{"prompt": "a lighthouse", "size": '}
    data = {k: str(v) for k, v in base.items()}
    if bad == "not_image":
        return {"kind": "bad", "bad": bad, "path": "/v1/images/edits", "data": data,
                "files": {"image": ("photo.png", rng.randbytes(4096), "image/png")}}
    return {"kind": "bad", "bad": bad, "path": "/v1/images/edits", "data": data,  # mask_size
            "files": {"image": ("photo.png", noise_png(256, 256, rng), "image/png"),
                      "mask": ("mask.png", mask_png(128, 128), "image/png")}}


async def send(client, url: str, req: dict, timeout_s: float, gone_after: float | None, details: list) -> str:
    """Send ``req``; the outcome: ``ok``, ``4xx``, ``503``, ``5xx``, ``disconnected``, ``lost`` or ``hung``."""
    import httpx

    async def go() -> str:
        kw: dict = {}
        if "json" in req:
            kw["json"] = req["json"]
        elif "content" in req:
            kw.update(content=req["content"], headers={"Content-Type": "application/json"})
        else:
            kw.update(files=req["files"], data=req["data"])
        if req.get("stream"):
            async with client.stream("POST", url + req["path"], **kw) as r:
                if r.status_code != 200:
                    await r.aread()
                    return _status(r.status_code)
                text = ""
                async for chunk in r.aiter_text():
                    text += chunk
                done = text.count(".completed")
                if done >= req["n"] and "event: error" not in text:
                    return "ok"
                details.append({"kind": req["kind"], "stream_tail": text[-300:]})
                return "5xx"
        r = await client.post(url + req["path"], **kw)
        if r.status_code == 200:
            return "ok" if len(r.json().get("data", ())) == req.get("n", -1) else "5xx"
        if r.status_code >= 500 and r.status_code != 503 or (r.status_code < 500 and req["kind"] != "bad"):
            details.append({"kind": req["kind"], "status": r.status_code, "answer": r.text[:300]})
        return _status(r.status_code)

    try:
        if gone_after is not None:
            try:
                return await asyncio.wait_for(go(), gone_after)
            except asyncio.TimeoutError:
                return "disconnected"
        return await asyncio.wait_for(go(), timeout_s)
    except asyncio.TimeoutError:
        return "hung"
    except httpx.HTTPError:
        return "lost"


def _status(code: int) -> str:
    if code == 503:
        return "503"
    return "4xx" if 400 <= code < 500 else "5xx"
