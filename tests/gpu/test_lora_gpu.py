"""LoRA per request under CUDA graphs, in each kernel tier, on the tiny FLUX.1-dev checkpoint.

For ``eager``, ``compiled`` and ``fp8`` kernels (fp8 where the GPU has float8 matmuls and torchao is installed):
rows of no adapter, adapter a and adapters a + b share replayed bucket graphs, and each request's final latents
match the same request served alone by a reference pipeline within the tier's bound: for eager kernels in fp32,
the CPU's fp32 run within 1e-4 relative (the gate's CUDA bound, ``tests/gpu/test_family_gate.py``); otherwise
eager kernels in the same dtype on CUDA, within the bucket check's tolerance of the tier (``/v1/buckets``
``kernels.rtol``). Loading an adapter copies into the slot buffers in place: the graphs captured at start serve
it (no capture after start). TF32 is off. Passed on an H200 on 2026-12-03 (4 tests, 122 s; docs/BENCHMARKS.md).
"""

import pytest
import torch
from diffusers import FluxPipeline

from bcg_core import GenerationRequest
from reference_gate import bcg_pipeline, bcg_run, diffusers_run
from tiny.flux import TEXT_TOKENS, build
from tiny.lora import make_adapter

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.usefixtures("no_tf32")]

BUCKETS = {"batch_sizes": [1, 2, 4], "resolutions": ["32x32"], "text_lengths": [TEXT_TOKENS]}
LORA = {"slots": 2, "max_rank": 4, "max_per_request": 2}



@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    folder = build(tmp_path_factory.mktemp("lora-gpu") / "flux", "dev")
    loras = make_adapter(FluxPipeline, folder, "a", ["to_q", "to_k", "to_v", "to_out.0", "ff.net.2", "proj_mlp"])
    make_adapter(FluxPipeline, folder, "b", ["to_q", "add_k_proj", "norm1.linear"], rank=2, seed=1, as_file=True)
    return folder, loras


def _req(**kw) -> GenerationRequest:
    return GenerationRequest(**{"prompt": "a photo of a cat", "n": 1, "width": 32, "height": 32, "seed": 3,
                                "num_inference_steps": 3, "guidance_scale": 3.5, **kw})


def _fp8_ready() -> bool:
    import importlib.util

    return torch.cuda.get_device_capability() >= (8, 9) and importlib.util.find_spec("torchao") is not None


@pytest.mark.parametrize("kernels", ["eager", "compiled", "fp8"])
def test_adapters_in_replayed_graphs_match_eager_in_each_tier(ckpt, kernels):
    if kernels == "fp8" and not _fp8_ready():
        pytest.skip("float8 matmuls need compute capability 8.9+ and torchao")
    folder, loras = ckpt
    dtype = "float32" if kernels == "eager" else "bfloat16"
    lora = {"dir": str(loras), **LORA}
    pipe = bcg_pipeline(folder, BUCKETS, device="cuda", dtype=dtype, kernels=kernels, lora=lora)
    assert {d["mode"] for d in pipe.runner.describe()} == {"graph"}
    # the reference: fp32 on the CPU for eager kernels; eager kernels in the same dtype on CUDA otherwise
    ref = bcg_pipeline(folder, BUCKETS, lora=lora) if kernels == "eager" else \
        bcg_pipeline(folder, BUCKETS, device="cuda", dtype=dtype, lora=lora)
    captures = sum(d.get("capture_s", 0) > 0 for d in pipe.runner.describe())
    reqs = [_req(seed=1), _req(seed=2, lora=(("a", 0.8),)), _req(seed=3, lora=(("a", 1.0), ("b", -0.6)))]
    validated_requests = [pipe.validator.validate(r) for r in reqs]
    leases = [pipe.lease(p) for p in validated_requests]
    states = [pipe.start(p, lease=lease) for p, lease in zip(validated_requests, leases, strict=True)]
    while not all(s.done for s in states):
        live = [s for s in states if not s.done]
        pipe.step(live, pipe.decider.for_states(live))  # the three share each step's forward (3 rows -> bucket 4)
    for lease in leases:
        if lease is not None:
            lease.release()
    rtol = 1e-4 if kernels == "eager" else pipe.stats()["kernels"]["rtol"]
    for validated, state in zip(validated_requests, states, strict=True):
        want = bcg_run(ref, validated.request).latents
        got = state.latents.float().cpu()
        err = ((got - want).abs().max() / want.abs().max()).item()
        assert err <= rtol, (kernels, validated.request.lora, err, rtol)
    assert sum(d.get("capture_s", 0) > 0 for d in pipe.runner.describe()) == captures  # no capture for a load


def test_fp32_graphs_with_adapters_equal_diffusers_on_cuda(ckpt):
    folder, loras = ckpt
    pipe = bcg_pipeline(folder, BUCKETS, device="cuda", lora={"dir": str(loras), **LORA})
    req = pipe.validator.validate(_req(lora=(("a", 0.8), ("b", 0.5)))).request
    ours = bcg_run(pipe, req)
    theirs = diffusers_run(FluxPipeline, folder, req, device="cuda", lora_dir=loras, max_sequence_length=TEXT_TOKENS)
    err = ((ours.latents - theirs.latents).abs().max() / theirs.latents.abs().max()).item()
    assert err <= 1e-4, err


def test_forwards_without_adapter_rows_replay_the_plain_graph(ckpt):
    """Each bucket also holds a graph captured without the LoRA deltas; a forward whose rows carry no adapter
    replays it and equals a pipeline without ``lora.dir`` bit for bit (same graphs' kernels, fp32), while a forward
    with an adapter row still replays the LoRA graph (it differs). Written 2026-12-03; not yet run on a GPU."""
    folder, loras = ckpt
    pipe = bcg_pipeline(folder, BUCKETS, device="cuda", lora={"dir": str(loras), **LORA})
    plain = bcg_pipeline(folder, BUCKETS, device="cuda")
    assert all(d["mode"] == "graph" and d["plain_graph"] for d in pipe.runner.describe())
    req = pipe.validator.validate(_req(n=3, seed=4)).request
    assert torch.equal(bcg_run(pipe, req).latents, bcg_run(plain, req).latents)
    with_a = pipe.validator.validate(_req(n=3, seed=4, lora=(("a", 1.0),))).request
    assert not torch.equal(bcg_run(pipe, with_a).latents, bcg_run(plain, req).latents)


def test_compiled_blocks_update_each_base_output_in_place_on_cuda():
    """Inductor's CUDA code (bf16, Triton and cuBLAS) applies ``bcg::lora_add_`` to each base layer's output buffer
    without a clone, so a compiled plain forward pays nothing per wrapped layer; with rows it equals eager within
    bf16 rounding. The CPU's code is checked in ``tests/unit/test_lora_layers.py``."""
    from pathlib import Path

    from torch._inductor.utils import run_and_get_code

    from bcg_core.lora.files import AdapterWeights, LayerDelta
    from bcg_core.lora.layers import LoRALayers

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = torch.nn.Linear(256, 512), torch.nn.Linear(512, 256, bias=False)

        def forward(self, x):
            return x + self.down(torch.nn.functional.gelu(self.up(x)))

    torch.manual_seed(0)
    m = Block().to("cuda", torch.bfloat16)
    layers = LoRALayers(m, slots=2, max_rank=8, max_per_request=2)
    g = torch.Generator().manual_seed(1)
    layers.write(1, AdapterWeights("a", Path("a"), {n: LayerDelta(torch.randn(8, i, generator=g) * 0.1,
                                                                  torch.randn(o, 8, generator=g) * 0.1, 0.5)
                                                    for n, (i, o) in layers.shapes().items()}))
    x = torch.randn(3, 64, 256, device="cuda", dtype=torch.bfloat16)
    compiled = torch.compile(m, fullgraph=True, dynamic=False)
    slots = torch.tensor([[1, 0], [0, 0], [1, 1]], device="cuda")
    scales = torch.tensor([[0.8, 0.0], [0.0, 0.0], [0.5, -0.5]], device="cuda")
    with torch.no_grad():
        _, code = run_and_get_code(compiled, x)
        with layers.rows(slots, scales):
            got, want = compiled(x).float(), m(x).float()
    assert ((got - want).abs().max() / want.abs().max()).item() < 2e-2
    assert not torch.equal(got[0], got[1])  # the adapter row differs from the plain one
    src = "\n".join(code)
    assert src.count("torch.ops.bcg.lora_add_") == 2 and "clone" not in src, src
