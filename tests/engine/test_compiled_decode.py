"""The compiled VAE decode (``runner.compile_decode``, ``bcg_core/runners/decode.py``) on the CPU.

A real inductor compile of the tiny VAE takes about 20 s on this CPU, so most tests pass stand-ins for the compile
(which decide what the "compiled" decode returns) and for the timer (which decide the measurement); one runs dynamo
itself with its ``eager`` backend (its guards, its recompile limit, ``torch._dynamo.run``); the inductor compile runs
in ``tests/gpu/test_kernels_gpu.py``."""

from __future__ import annotations

import functools
import threading

import pytest
import torch
from diffusers import AutoencoderKL

from bcg_core import BucketConfig, EngineConfig, GenerationRequest
from bcg_core.config import RunnerConfig
from bcg_core.families.tiny import tiny_vae_config
from bcg_core.models import load_model
from bcg_core.pipeline import DiTPipeline
from bcg_core.runners.decode import CompiledDecode, install, unsupported


class Counted:
    """A stand-in compile: ``fn`` itself, plus ``offset`` (a broken compile when non-zero), counting calls."""

    def __init__(self, offset: float = 0.0, fail: bool = False):
        self.offset, self.fail, self.calls, self.compiles = offset, fail, 0, 0

    def __call__(self, fn, dynamic=None):
        assert dynamic is False  # one static compile per shape
        self.compiles += 1
        if self.fail:
            raise RuntimeError("inductor: no C++ compiler")

        def compiled(z, return_dict=True):
            self.calls += 1
            out = fn(z, return_dict=return_dict)
            return (out[0] + self.offset,) if self.offset else out
        return compiled


def timer(faster: str):
    """A fake timer where path ``faster`` takes 1 ms and the other 2 ms."""
    def time_it(path, call):
        call()
        return 1e-3 if path == faster else 2e-3
    return time_it


@pytest.fixture
def vae():
    torch.manual_seed(0)
    return AutoencoderKL(**tiny_vae_config()).eval()


def latents(*shape):
    """Random latents made under inference mode (inference tensors), as the families' decodes make theirs."""
    with torch.inference_mode():
        return torch.randn(*shape)


class Holder:
    def __init__(self, vae):
        self.vae = vae


def _decode(vae, z):
    with torch.inference_mode():
        return vae.decode(z, return_dict=False)[0]


def test_a_new_shape_decodes_eager_then_compiled_once_measured_faster(vae):
    z = latents(2, vae.config.latent_channels, 8, 8)
    ref = _decode(vae, z)
    compile_fn = Counted()
    decoder = install(Holder(vae), compile_fn=compile_fn, guarded=False, timer=timer("compiled"))
    assert install(Holder(vae)) is decoder  # installed once
    first = _decode(vae, z)  # eager, and the shape goes to the background compile
    assert decoder.wait(60)
    shape = decoder.describe()["shapes"]["2x16x8x8 float32"]
    assert shape["state"] == "compiled" and shape["compiled_ms"] < shape["eager_ms"], shape
    assert 0 <= shape["rel_err"] <= shape["rtol"] and "float64" in shape["note"]  # the eager decode's own rounding
    calls = compile_fn.calls
    second = _decode(vae, z)
    assert compile_fn.calls == calls + 1 and compile_fn.compiles == 1
    assert torch.equal(first, ref) and torch.equal(second, ref)
    d = decoder.describe()
    assert (d["eager_calls"], d["compiled_calls"], d["skipped"]) == (1, 1, 0)
    _decode(vae, latents(1, vae.config.latent_channels, 8, 8))  # another shape: eager, queued
    assert decoder.wait(60) and len(decoder.describe()["shapes"]) == 2
    decoder.close()


@pytest.mark.parametrize("case", ["slower", "deviates", "raises"])
def test_a_compiled_decode_that_is_slower_deviates_or_fails_is_not_kept(vae, case):
    z = latents(1, vae.config.latent_channels, 8, 8)
    ref = _decode(vae, z)
    compile_fn = Counted(offset=0.5 if case == "deviates" else 0.0, fail=case == "raises")
    decoder = install(Holder(vae), compile_fn=compile_fn, guarded=False,
                      timer=timer("eager" if case == "slower" else "compiled"))
    _decode(vae, z)
    assert decoder.wait(60)
    shape = decoder.describe()["shapes"]["1x16x8x8 float32"]
    want = {"slower": "eager_faster", "deviates": "check_failed", "raises": "failed"}[case]
    assert shape["state"] == want, shape
    if case == "raises":
        assert shape["note"].startswith("compile_failed: RuntimeError: inductor: no C++ compiler")
    if case == "deviates":
        assert shape["rel_err"] > shape["rtol"]
    calls = compile_fn.calls
    assert torch.equal(_decode(vae, z), ref) and compile_fn.calls == calls  # eager from now on, still serving
    assert decoder.describe()["compiled_calls"] == 0


def test_shapes_past_max_shapes_stay_eager_and_are_counted(vae):
    decoder = CompiledDecode(vae, max_shapes=1, compile_fn=Counted(), guarded=False, timer=timer("compiled"))
    vae.decode = decoder
    for side in (8, 12, 16):
        _decode(vae, latents(1, vae.config.latent_channels, side, side))
    assert decoder.wait(60)
    d = decoder.describe()
    assert list(d["shapes"]) == ["1x16x8x8 float32"] and d["skipped"] == 2 and d["eager_calls"] == 3


def test_the_pipeline_installs_it_only_with_a_compiled_tier_and_routes_the_familys_decode_through_it():
    table = BucketConfig(batch_sizes=[1], resolutions=["256x256"], text_lengths=[256])
    eager = EngineConfig(buckets=table, runner=RunnerConfig(kernels="eager", compile_decode=True))
    model = load_model(eager.model)
    pipe = DiTPipeline(eager, model)
    assert pipe.decoder is None and pipe.stats()["kernels"]["decode"] == {"enabled": False, "note": ""}
    request = GenerationRequest("a red fox in snow", n=1, width=256, height=256, num_inference_steps=1, seed=3)
    ref = pipe.generate(pipe.validator.validate(request)).image_bytes
    # what DiTPipeline does for a compiled tier, with the stand-ins: the family's own decode call goes through it
    decoder = install(model, compile_fn=Counted(), guarded=False, timer=timer("compiled"))
    assert pipe.generate(pipe.validator.validate(request)).image_bytes == ref and decoder.wait(60)
    assert pipe.generate(pipe.validator.validate(request)).image_bytes == ref
    assert decoder.describe()["compiled_calls"] == 1
    compiled = EngineConfig(buckets=table, runner=RunnerConfig(kernels="compiled", compile_decode=True))
    assert DiTPipeline(compiled, model, prepare=False).decoder is decoder  # a compiled tier installs it, once


def test_with_dynamo_a_kept_shape_never_compiles_on_the_request_path_and_the_limit_holds_every_shape(vae):
    """Dynamo itself (its tracing and guards; a backend that runs the traced graph as is, no inductor): more shapes
    than the recompile limit set here each get their own checked graph, and a call that misses the guards of a kept
    shape (another grad mode) runs eager kernels: it is another shape, queued, never compiled on the caller's
    thread."""
    torch._dynamo.reset()
    # torch's own patch (pytest's monkeypatch deletes a torch config entry on undo); CompiledDecode raises the limit
    with torch._dynamo.config.patch(recompile_limit=2, accumulated_recompile_limit=2):
        _kept_shapes_with_dynamo(vae)
    torch._dynamo.reset()


def _kept_shapes_with_dynamo(vae):
    graphs, runs = [], []

    def backend(gm, example_inputs):
        graphs.append(threading.current_thread().name)

        def run(*args):
            runs.append(threading.current_thread().name)
            return gm.forward(*args)
        return run

    decoder = install(Holder(vae), max_shapes=4, compile_fn=functools.partial(torch.compile, backend=backend),
                      timer=timer("compiled"))
    assert torch._dynamo.config.recompile_limit >= 4
    shapes = [latents(b, vae.config.latent_channels, 8, 8) for b in (1, 2, 3)]
    for z in shapes:
        _decode(vae, z)
    assert decoder.wait(120)
    d = decoder.describe()
    assert [s["state"] for s in d["shapes"].values()] == ["compiled"] * 3, d
    assert len(graphs) >= 3 and set(graphs) == {"bcg-decode-compile"}  # every graph built off the request path
    built, ran = len(graphs), len(runs)
    for z in shapes:  # kept: through torch._dynamo.run, the checked graphs, nothing new
        with torch.inference_mode():
            ref = type(vae).decode(vae, z, return_dict=False)[0]
        assert torch.allclose(_decode(vae, z), ref, atol=1e-6)
    assert decoder.describe()["compiled_calls"] == 3 and len(graphs) == built
    assert runs[ran:] and set(runs[ran:]) == {"MainThread"}  # the checked graphs ran, on the caller's thread
    with torch.no_grad():  # grad mode: another key (its guards would miss); eager here, queued
        vae.decode(shapes[0], return_dict=False)
    assert decoder.wait(120) and any(k.endswith("grad-mode") for k in decoder.describe()["shapes"])
    assert set(graphs) == {"bcg-decode-compile"}
    decoder.close()


def test_a_vae_that_keeps_per_call_state_is_refused_with_its_reason():
    class Stateful(torch.nn.Module):  # as diffusers' AutoencoderKLQwenImage: a causal-conv cache on the module
        def clear_cache(self):
            self._feat_map = []

        def decode(self, z, return_dict=True):
            return (z,)

    vae = Stateful()
    reason = install(Holder(vae))
    assert isinstance(reason, str) and reason == unsupported(vae) and "Stateful keeps per-call state" in reason
    assert "decode" not in vae.__dict__  # nothing installed: its decode stays the class's own
    with pytest.raises(ValueError, match="per-call state"):
        CompiledDecode(vae)
