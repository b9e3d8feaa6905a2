"""LoRA per request in the engine, on the tiny FLUX.1-dev checkpoint (``tests/tiny/flux.py``) with peft-made adapters.

Rows of different adapters in one forward each equal their request alone and diffusers' own pipeline with
``load_lora_weights`` and ``set_adapters``; an evicted and reloaded adapter gives the same image; a pinned slot is
never evicted and a request that cannot get a slot in time is a 503; every bad input is a clear error and the
pipeline serves on. The family-by-family gate is ``tests/families/test_lora_families.py``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import threading

import numpy as np
import pytest
import torch
from diffusers import FluxPipeline
from safetensors.torch import load_file, save_file

from bcg_core import GenerationRequest
from bcg_core.errors import RequestError, ServiceUnavailable
from reference_gate import PIXEL_SHARE, assert_same, bcg_pipeline, bcg_run, diffusers_run, pixels
from tiny.flux import TEXT_TOKENS, build
from tiny.lora import make_adapter

BUCKETS = dict(batch_sizes=[1, 2, 4], resolutions=["32x32"], text_lengths=[TEXT_TOKENS])
REF = dict(max_sequence_length=TEXT_TOKENS)
ATTN_MLP = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "ff.net.2", "proj_mlp", "norm1.linear"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """The checkpoint, its ``loras`` folder (a, b good; big of rank 8; broken ones) and a pipeline serving it with
    2 slots of rank 4, 2 adapters per request."""
    folder = build(tmp_path_factory.mktemp("lora") / "flux", "dev")
    loras = make_adapter(FluxPipeline, folder, "a", ATTN_MLP, rank=4, alpha=8, rank_pattern={"to_q": 2})
    make_adapter(FluxPipeline, folder, "b", ["to_k", "to_v", "proj_out"], rank=3, alpha=3, seed=1, metadata=False,
                 as_file=True)
    make_adapter(FluxPipeline, folder, "c", ["to_q", "ff.net.2"], rank=2, alpha=4, seed=2, as_file=True)
    make_adapter(FluxPipeline, folder, "big", ["to_q"], rank=8, seed=3, as_file=True)
    make_adapter(FluxPipeline, folder, "dora", ["to_q"], rank=2, seed=4, as_file=True, use_dora=True)
    (loras / "garbage.safetensors").write_bytes(b"not a safetensors file at all")
    good = load_file(str(loras / "c.safetensors"))
    key = next(k for k in good if "lora_A" in k)
    save_file({**good, key: torch.zeros(2, 7)}, str(loras / "misfit.safetensors"))
    save_file({key: good[key]}, str(loras / "lonely.safetensors"))  # lora_A of rank 2, no lora_B
    b_key = key.replace("lora_A", "lora_B")
    save_file({key: torch.zeros(0, good[key].shape[1]), b_key: torch.zeros(good[b_key].shape[0], 0)},
              str(loras / "rank0.safetensors"))
    save_file({"transformer.no_such_layer.lora_A.weight": torch.zeros(2, 8),
               "transformer.no_such_layer.lora_B.weight": torch.zeros(8, 2)}, str(loras / "stranger.safetensors"))
    save_file({**good, "text_encoder.text_model.encoder.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(2, 32),
               "text_encoder.text_model.encoder.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(32, 2)},
              str(loras / "textual.safetensors"))
    (folder.parent / "outside.safetensors").write_bytes((loras / "c.safetensors").read_bytes())
    os.symlink(folder.parent / "outside.safetensors", loras / "escape.safetensors")
    pipe = bcg_pipeline(folder, BUCKETS, lora={"dir": str(loras), "slots": 2, "max_rank": 4, "max_per_request": 2,
                                               "load_timeout_s": 0.5})
    return folder, loras, pipe


def _req(**kw) -> GenerationRequest:
    base = dict(prompt="a photo of a cat", n=1, width=32, height=32, num_inference_steps=3, guidance_scale=3.5, seed=7)
    return GenerationRequest(**{**base, **kw})


def test_rows_of_different_adapters_in_one_forward_each_equal_diffusers(ckpt):
    """A request with no adapter, one with a, one with b (scale -0.5) and one with a and b, stepping together in one
    forward through the step scheduler (2 slots hold a and b): each equals diffusers' pipeline with the same
    adapters, alone."""
    from bcg_core.scheduler import StepScheduler

    folder, loras, pipe = ckpt
    reqs = [_req(seed=1), _req(seed=2, lora=(("a", 0.8),)), _req(seed=3, lora=(("b", -0.5),)),
            _req(seed=4, n=1, lora=(("a", 1.0), ("b", 0.6)))]
    validated_requests = [pipe.validator.validate(r) for r in reqs]
    sched = StepScheduler(pipe)

    async def run_all():
        return await asyncio.gather(*(sched.submit(p) for p in validated_requests))

    try:
        results = asyncio.run(run_all())
    finally:
        sched.close()
    assert max(r.batch_size for r in results) > 1  # they shared forwards
    for validated, result in zip(validated_requests, results, strict=True):
        ref = diffusers_run(FluxPipeline, folder, validated.request, lora_dir=loras, **REF)
        assert_same(bcg_run(pipe, validated.request), ref)  # alone: latents and images
        for ours, theirs in zip(result.image_bytes, ref.pngs, strict=True):  # shared: the scheduler's images
            d = np.abs(pixels(ours) - pixels(theirs))
            assert d.max() <= 1 and (d > 0).mean() <= PIXEL_SHARE
    plain = bcg_run(pipe, dataclasses.replace(validated_requests[1].request, lora=()))
    assert (plain.latents - bcg_run(pipe, validated_requests[1].request).latents).abs().max() > 1e-2  # the adapter acts
    assert pipe.stats()["lora"]["pinned"] == {}  # every lease was released


def test_forwards_without_adapter_rows_run_no_lora_kernel_and_equal_the_plain_model(ckpt, monkeypatch):
    """A forward whose rows all lack adapters runs the bucket without the deltas (the CUDA graph runner's second
    graph; here the static padded forward): no ``bcg::lora_add_`` call, and latents bit-equal to a pipeline
    without ``lora.dir``. A forward with one adapter row beside them calls it on every wrapped layer."""
    import bcg_core.lora.layers as layers

    folder, loras, pipe = ckpt
    calls = []
    real = layers.lora_add_
    monkeypatch.setattr(layers, "lora_add_", lambda *a: calls.append(1) or real(*a))
    plain = bcg_pipeline(folder, BUCKETS)
    want = bcg_run(plain, _req(seed=5, n=3)).latents
    got = bcg_run(pipe, _req(seed=5, n=3)).latents  # 3 rows padded into the 4-row bucket
    assert calls == [] and torch.equal(got, want)
    bcg_run(pipe, _req(seed=5, lora=(("a", 0.5),)))
    assert len(calls) == 3 * len(pipe.lora.layers.layers)  # 3 steps, every wrapped layer


def test_a_step_mixing_adapter_rows_runs_as_two_where_the_measured_costs_say_so(ckpt):
    """Measured costs hold each bucket's forward with adapter rows (``lora_ms``) beside its plain one. With
    compute-bound costs (time grows with rows, adapter rows 1.5x) a step of a plain request and an adapter request
    runs as two steps, plain rows on the plain forward; with launch-bound costs (one forward of any rows about as
    dear as another) it stays one. Either way each image equals its request served alone."""
    from bcg_core.costs import CostModel
    from bcg_core.scheduler import StepScheduler

    folder, loras, pipe = ckpt
    keys = sorted(pipe.table.keys, key=lambda k: k.batch)
    measured = pipe.measure_costs(keys, iters=1)
    assert set(measured.lora_ms) == set(keys) and all(v > 0 for v in measured.lora_ms.values())
    assert set(measured.describe()["lora_ms"]) == {str(k) for k in keys}
    reqs = [_req(seed=11), _req(seed=12, lora=(("a", 0.8),))]
    alone = [bcg_run(pipe, r) for r in reqs]
    compute = CostModel({k: float(k.batch) for k in keys}, eager=False, lora_ms={k: 1.5 * k.batch for k in keys})
    launch = CostModel({k: 1.0 + 0.01 * k.batch for k in keys}, eager=False,
                       lora_ms={k: 1.5 + 0.01 * k.batch for k in keys})
    shape = keys[0].shape
    assert compute.lora_factor(keys[0]) == 1.5 and CostModel({}).lora_factor(keys[0]) == 1.0
    before = pipe.decider.costs
    try:
        for costs, splits in ((compute, True), (launch, False)):
            pipe.decider.set_costs(costs, merge=False)
            assert pipe.decider.split_adapters(shape, 1, 1) is splits
            assert not pipe.decider.split_adapters(shape, 0, 2) and not pipe.decider.split_adapters(None, 1, 1)
            sched = StepScheduler(pipe)

            async def run_all():  # run at once below, with this iteration's scheduler
                return await asyncio.gather(*(sched.submit(pipe.validator.validate(r)) for r in reqs))  # noqa: B023

            try:
                results = asyncio.run(run_all())
                stats = sched.stats()
            finally:
                sched.close()
            assert (stats["adapter_splits"] > 0) is splits, stats["adapter_splits"]
            for result, ref in zip(results, alone, strict=True):
                for ours, theirs in zip(result.image_bytes, ref.pngs, strict=True):
                    d = np.abs(pixels(ours) - pixels(theirs))
                    assert d.max() <= 1 and (d > 0).mean() <= PIXEL_SHARE
    finally:
        pipe.decider.set_costs(before, merge=False)


def test_bucket_checks_cover_the_graph_for_adapter_rows_too(ckpt, monkeypatch):
    """``bcg verify``'s padded-against-unpadded check runs each case through both of a LoRA deployment's bucket
    paths (no adapter rows; slot-0 adapter rows), each within the check's bound."""
    import bcg_core.lora.layers as layers
    from bcg_core.verify import verify_runner
    from bcg_core.verify_inputs import boundary_cases

    folder, loras, pipe = ckpt
    calls = []
    real = layers.lora_add_
    monkeypatch.setattr(layers, "lora_add_", lambda *a: calls.append(1) or real(*a))
    cases = [c for c in boundary_cases(pipe.table, pipe.config.limits) if c.key is not None][:2]
    verdicts = verify_runner(pipe.model.adapter, pipe.runner, cases, pipe.model.device, pipe.model.dtype, rtol=1e-5)
    assert verdicts and all(v.passed for v in verdicts), [(str(v.key), v.max_rel_err) for v in verdicts]
    assert len(calls) == len(cases) * len(pipe.lora.layers.layers)  # the adapter-row path ran once per case


def test_an_evicted_adapter_reloads_to_the_same_image(ckpt):
    folder, loras, pipe = ckpt
    first = bcg_run(pipe, _req(lora=(("c", 0.7),)))
    for name in ("a", "b"):  # 2 slots: a and b push c out
        bcg_run(pipe, _req(lora=((name, 1.0),)))
    d = pipe.lora.describe()
    assert "c" not in d["resident"] and d["adapters"]["c"]["evictions"] >= 1
    loads = d["adapters"]["c"]["loads"]
    again = bcg_run(pipe, _req(lora=(("c", 0.7),)))
    assert torch.equal(first.latents, again.latents) and first.pngs == again.pngs
    assert pipe.lora.describe()["adapters"]["c"]["loads"] == loads + 1


def test_a_pinned_slot_is_never_evicted_and_a_request_without_a_slot_gets_503(ckpt):
    folder, loras, pipe = ckpt
    slots = pipe.lora
    held = [slots.lease(("a",), (1.0,)), slots.lease(("b",), (1.0,))]  # both slots pinned
    try:
        before = dataclasses.replace(slots.counts["c"])
        with pytest.raises(ServiceUnavailable) as e:
            slots.lease(("c",), (1.0,))
        assert e.value.status == 503 and e.value.field == "lora" and "load_timeout_s" in e.value.message

        async def gives_up():  # a client that disconnects while it waits for a slot
            task = asyncio.ensure_future(slots.lease_async(("c",), (1.0,)))
            await asyncio.sleep(0.1)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

        asyncio.run(gives_up())
        with pytest.raises(ServiceUnavailable):  # the awaited lease's own deadline: a 503 too
            asyncio.run(slots.lease_async(("c",), (1.0,)))
        a_timeouts = slots.counts["a"].timeouts
        with pytest.raises(ServiceUnavailable):  # a is resident: only c, which it waited for, counts the 503
            slots.lease(("a", "c"), (1.0, 1.0))
        counts = slots.describe()["adapters"]["c"]  # each outcome is counted (/v1/buckets, Prometheus)
        assert counts["timeouts"] == before.timeouts + 3 and counts["cancelled"] == before.cancelled + 1
        assert counts["requests"] == before.requests + 4 and counts["loads"] == before.loads
        assert slots.counts["a"].timeouts == a_timeouts
        assert set(slots.resident()) == {"a", "b"}
        got = []
        t = threading.Thread(target=lambda: got.append(slots.lease(("c",), (1.0,))))
        t.start()
        held.pop(0).release()  # a's slot frees: c loads there
        t.join(5)
        assert got and got[0].names == ("c",) and "a" not in slots.resident()
        got[0].release()
    finally:
        for lease in held:
            lease.release()


@pytest.mark.parametrize("name, words", [
    ("nope", "no adapter 'nope' in lora.dir; adapters: a, b, big, c, dora"),  # the list starts so
    ("garbage", "is not a LoRA file diffusers can read"),
    ("misfit", "the layer takes"),
    ("lonely", "has only one of lora_A and lora_B"),
    ("rank0", "not a matrix of rank 1 or more"),
    ("stranger", "changes layer no_such_layer, which is not a linear layer"),
    ("big", "rank 8, above lora.max_rank 4"),
    ("dora", "DoRA"),
    ("textual", "changes a text encoder"),
    ("escape", "links outside lora.dir"),
])
def test_an_adapter_that_cannot_be_served_is_a_422_and_the_pipeline_serves_on(ckpt, name, words):
    folder, loras, pipe = ckpt
    with pytest.raises(RequestError) as e:
        pipe.generate(pipe.validator.validate(_req(lora=((name, 1.0),))))
    assert e.value.status == 422 and e.value.field == "lora" and words in e.value.message, e.value.message
    assert str(loras) not in e.value.message  # the folder is not shown to clients
    assert pipe.generate(pipe.validator.validate(_req(lora=(("a", 0.5),)))).image_bytes  # serves on
    assert pipe.stats()["lora"]["pinned"] == {}


@pytest.mark.parametrize("lora, words", [
    ((("a", 1.0), ("b", 1.0), ("c", 1.0)), "more than 2 adapters"),
    ((("a", 4.5),), "out of range"),
    ((("a", float("nan")),), "out of range"),
    ((("../a", 1.0),), "not an adapter name"),
    ((("a", 1.0), ("a", 0.5)), "named twice"),
])
def test_the_validator_refuses_bad_lora_fields(ckpt, lora, words):
    folder, loras, pipe = ckpt
    with pytest.raises(RequestError) as e:
        pipe.validator.validate(_req(lora=lora))
    assert e.value.field == "lora" and words in e.value.message and "allowed:" in e.value.message


def test_adapters_on_a_pipeline_without_lora_dir_are_refused(ckpt):
    folder, loras, _ = ckpt
    plain = bcg_pipeline(folder, BUCKETS)
    with pytest.raises(RequestError) as e:
        plain.validator.validate(_req(lora=(("a", 1.0),)))
    assert "serves no LoRA adapters" in e.value.message
    assert plain.lora is None and plain.stats()["lora"] is None


def test_a_load_in_progress_never_stalls_other_requests(ckpt, monkeypatch):
    """While an adapter's file is being read (held here until released), a request without adapters runs to its
    answer through the same step scheduler; then the adapter's request is served too."""
    from bcg_core.scheduler import StepScheduler

    folder, loras, pipe = ckpt
    make_adapter(FluxPipeline, folder, "slow", ["to_q", "proj_mlp"], rank=2, seed=9, as_file=True)  # never loaded
    entered, release = threading.Event(), threading.Event()
    read = pipe.lora.files.read

    def slow_read(name):
        entered.set()
        assert release.wait(30), "the test never released the load"
        return read(name)

    monkeypatch.setattr(pipe.lora.files, "read", slow_read)
    sched = StepScheduler(pipe)

    async def run():
        waiting = asyncio.ensure_future(sched.submit(pipe.validator.validate(_req(seed=5, lora=(("slow", 1.0),)))))
        await asyncio.get_running_loop().run_in_executor(None, entered.wait, 30)
        plain = await asyncio.wait_for(sched.submit(pipe.validator.validate(_req(seed=6))), 60)
        assert not waiting.done()  # the load is still held: the plain request did not wait for it
        release.set()
        return plain, await asyncio.wait_for(waiting, 60)

    try:
        plain, loaded = asyncio.run(run())
    finally:
        release.set()
        sched.close()
    assert plain.image_bytes and loaded.image_bytes
    assert "lora_load" not in plain.timings_ms and loaded.timings_ms["lora_load"] > 0


def test_compiled_kernels_with_adapters_match_eager_and_load_precompiled_on_restart(ckpt, tmp_path):
    """The compiled tier on the CPU (torch.compile of the repeated blocks, the LoRA operator opaque inside them):
    a request with two adapters matches eager kernels within the compile check's tolerance, and a second start
    with the same cache loads every precompiled block instead of compiling it."""
    folder, loras, eager = ckpt
    one = dict(batch_sizes=[1], resolutions=["32x32"], text_lengths=[TEXT_TOKENS])
    lora = {"dir": str(loras), "slots": 2, "max_rank": 4, "max_per_request": 2}
    from bcg_core.config import EngineConfig, ModelConfig
    from bcg_core.pipeline import DiTPipeline

    def start():
        return DiTPipeline.from_config(EngineConfig(
            model=ModelConfig(path=str(folder)), buckets=one, limits={"min_side_px": 16, "max_side_px": 1024},
            runner={"kernels": "compiled", "compile_cache_dir": str(tmp_path)}, lora=lora))

    cold = start()
    k = cold.stats()["kernels"]
    assert k["tier"] == "compiled" and k["compile_failed"] == 0 and k["precompiled"]["saves"] > 0, k
    req = _req(lora=(("a", 0.9), ("b", -0.4)))
    got, want = cold.generate(cold.validator.validate(req)), eager.generate(eager.validator.validate(req))
    assert got.image_bytes and want.image_bytes
    ours, ref = bcg_run(cold, req).latents, bcg_run(eager, req).latents
    assert ((ours - ref).abs().max() / ref.abs().max()).item() <= max(k["rtol"], 1e-4)
    warm = start().stats()["kernels"]
    assert warm["precompiled"]["loads"] == k["precompiled"]["saves"] and warm["precompiled"]["saves"] == 0


def test_a_replaced_or_cut_file_is_loaded_again_or_refused_never_served_stale(ckpt):
    """The replica reads an adapter's file into its own memory (no map of the file) and keys what it holds by the
    file's stamp: a file rewritten while resident is loaded again on its next request; one cut to nothing after
    it was evicted is a 422 (not a crash from a mapped page that vanished); NaN weights are refused; a name with
    both layouts and a link out of the folder are listed once and not at all."""
    import shutil

    folder, loras, pipe = ckpt
    make_adapter(FluxPipeline, folder, "swap", ["to_q", "proj_mlp"], rank=2, seed=20, as_file=True)
    before = bcg_run(pipe, _req(lora=(("swap", 1.0),)))
    loads = pipe.lora.describe()["adapters"]["swap"]["loads"]
    make_adapter(FluxPipeline, folder, "swap2", ["to_q", "proj_mlp"], rank=2, seed=21, as_file=True)
    shutil.copyfile(loras / "swap2.safetensors", loras / "swap.safetensors")  # rewritten in place
    os.utime(loras / "swap.safetensors", ns=(1, 1))  # a stamp of its own even within the clock's resolution
    after = bcg_run(pipe, _req(lora=(("swap", 1.0),)))
    assert pipe.lora.describe()["adapters"]["swap"]["loads"] == loads + 1
    assert torch.equal(after.latents, bcg_run(pipe, _req(lora=(("swap2", 1.0),))).latents)
    assert not torch.equal(after.latents, before.latents)
    for name in ("a", "b"):  # push swap out of the 2 slots, then cut its file to nothing
        bcg_run(pipe, _req(lora=((name, 1.0),)))
    (loras / "swap.safetensors").write_bytes(b"")
    with pytest.raises(RequestError) as e:
        pipe.generate(pipe.validator.validate(_req(lora=(("swap", 1.0),))))
    assert e.value.status == 422 and "is not a LoRA file diffusers can read" in e.value.message

    bad = load_file(str(loras / "c.safetensors"))
    save_file({k: torch.full_like(v, float("nan")) for k, v in bad.items()}, str(loras / "nans.safetensors"))
    with pytest.raises(RequestError) as e:
        pipe.generate(pipe.validator.validate(_req(lora=(("nans", 1.0),))))
    assert "NaN or infinite weights" in e.value.message
    (loras / "c").mkdir(exist_ok=True)
    shutil.copyfile(loras / "c.safetensors", loras / "c" / "pytorch_lora_weights.safetensors")
    names = pipe.lora.files.names()
    assert names.count("c") == 1 and "escape" not in names
    assert "swap" not in names and "nans" in names  # an empty file is no LoRA file; NaNs are found on reading
    assert pipe.generate(pipe.validator.validate(_req(lora=(("a", 0.5),)))).image_bytes
    assert pipe.stats()["lora"]["pinned"] == {}


def test_lora_targets_are_checked_on_the_checkpoints_transformer_without_its_weights(ckpt, tmp_path):
    """``check_targets`` (run before Ray starts) builds the transformer of ``model.path`` on the meta device and
    wraps the same layers a replica wraps; a transformer it cannot build there is left to the replica's check."""
    import json

    from bcg_core import ModelConfig
    from bcg_core.lora.layers import check_targets

    folder, loras, pipe = ckpt
    check_targets(ModelConfig(path=str(folder)), ["*to_q"])
    with pytest.raises(ValueError, match=r"lora.targets \['nomatch.\*'\] match no linear layer of FluxTransformer"):
        check_targets(ModelConfig(path=str(folder)), ["nomatch.*"])
    odd = tmp_path / "odd" / "transformer"
    odd.mkdir(parents=True)
    odd.joinpath("config.json").write_text(json.dumps({"_class_name": "NoSuchTransformer"}))
    check_targets(ModelConfig(path=str(odd.parent)), ["nomatch.*"])  # not buildable here: no verdict
