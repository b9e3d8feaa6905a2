"""``benchmarks/bench_saturation.py`` on the CPU: its pure parts and the naive table against the real validator (the
tiny default's tokenizer, no weights). The end-to-end run is ``tests/serve/test_bench_saturation_serve.py``."""


import pytest

from benchmark_scripts import load

bench = load("bench_saturation")


# -- percentiles -----------------------------------------------------------------------------------------------


def test_percentile_is_linear_between_order_statistics_as_numpy():
    np = pytest.importorskip("numpy")
    values = [120.0, 5.0, 33.0, 7.5, 61.0, 2.0, 90.0]
    for q in (0, 1, 25, 50, 75, 99, 100):
        assert bench.percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    assert bench.percentile([3.0, 1.0], 50) == 2.0
    assert bench.percentile([4.0], 99) == 4.0
    assert bench.percentile([], 50) is None
    with pytest.raises(ValueError, match="from 0 to 100"):
        bench.percentile([1.0], 101)


# -- padded-token waste from GET /v1/buckets -------------------------------------------------------------------


def _stats(bucket_tokens, miss_tokens, scheduler=None):
    out = {"buckets": [{"key": f"b{i}", "real_tokens": r, "padded_tokens": p}
                       for i, (r, p) in enumerate(bucket_tokens)],
           "misses": {"requests": 1, "real_tokens": miss_tokens[0], "padded_tokens": miss_tokens[1]}}
    if scheduler is not None:
        out["scheduler"] = scheduler
    return out


def test_waste_without_scheduler_sums_buckets_and_misses_over_the_replay_window():
    after = _stats([(900, 1000), (0, 0), (300, 500)], (100, 100))
    w = bench.padded_token_waste(after)
    assert w["source"] == "buckets" and w["window"] == "since_start"
    assert (w["real_tokens"], w["padded_tokens"]) == (1300, 1600)
    assert w["waste"] == pytest.approx(1 - 1300 / 1600) == w["buckets_replay"]
    before = _stats([(400, 400), (0, 0), (300, 500)], (0, 0))  # the warm-up's counts are subtracted
    w = bench.padded_token_waste(after, before)
    assert w["window"] == "replay" and (w["real_tokens"], w["padded_tokens"]) == (600, 700)
    assert w["waste"] == pytest.approx(1 - 600 / 700)
    assert bench.padded_token_waste(_stats([(0, 0)], (0, 0)))["waste"] is None  # nothing computed


def test_waste_with_a_scheduler_section_uses_its_fraction_or_its_token_counters():
    sched = {"kind": "step", "padded_token_waste": 0.25}
    w = bench.padded_token_waste(_stats([(900, 1000)], (0, 0), sched), _stats([(0, 0)], (0, 0)))
    assert w["source"] == "scheduler" and w["waste"] == 0.25 and w["window"] == "since_start"
    assert w["buckets_replay"] == pytest.approx(0.1)  # the bucket counters are still reported beside it
    after = _stats([], (0, 0), {"padded_token_waste": 0.3, "real_tokens": 1000, "computed_tokens": 1500})
    before = _stats([], (0, 0), {"padded_token_waste": 0.0, "real_tokens": 200, "computed_tokens": 200})
    w = bench.padded_token_waste(after, before)
    assert w["source"] == "scheduler" and w["window"] == "replay"
    assert w["waste"] == pytest.approx(1 - 800 / 1300)


# -- the naive table against the real validator ------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny():
    from bcg_core.config import ModelConfig
    from bcg_core.models import describe_model, load_tokenizer_counter

    mc = ModelConfig(device="cpu")
    return mc, describe_model(mc), load_tokenizer_counter(mc)


def _configs(model_cfg: dict, spec, counter, reqs, steps=20):
    from deployments.settings import ServeConfig

    base = bench.base_config(model_cfg, spec, counter, reqs, steps)
    cache = {"method": "first_block", "threshold": 0.4}
    over = {s: bench.server_overrides(s, base, spec, reqs, 16, cache=cache) for s in bench.SERVERS}
    return base, over, {s: ServeConfig.model_validate(bench.merge(base, o)) for s, o in over.items()}


def test_naive_config_makes_every_one_of_the_first_32_krea_requests_miss(tiny):
    from bcg_core.validation import RequestValidator

    mc, spec, counter = tiny
    reqs = bench.replay_requests(32)
    assert len(reqs) == 32 and all(r.seed is not None for r in reqs)
    sent = reqs + bench.warmup_requests(reqs, "shapes") + bench.c1_requests(reqs, 5)
    base, over, cfgs = _configs(mc.model_dump(mode="json"), spec, counter, sent)
    naive = cfgs["naive"]
    assert naive.runner.mode == "eager"  # the step scheduler on the eager runner, every request a miss
    assert naive.buckets.miss_policy.value == "eager" and naive.buckets.batch_sizes == [1]
    assert naive.buckets.image_padding == "exact" and len(naive.buckets.resolutions) == 1
    assert naive.routing.max_ongoing_requests == 16  # admits the whole replay's concurrency: no 503
    validator = RequestValidator(naive, spec, counter)
    validated_requests, refused = bench.validate_all(validator, reqs, 20)
    assert refused == [] and len(validated_requests) == 32
    assert all(not p.lookup.hit for p in validated_requests)
    assert all("image_tokens" in [d.value for d in p.lookup.missed] for p in validated_requests)
    assert bench.check_all_miss(validator, sent, 20) == []
    # the step server is the configured one on the asked kernels (naive: always eager), its table holds every request
    assert over["step"] == {"runner": {"kernels": "eager"}} and naive.runner.kernels == "eager"
    assert bench.server_overrides("step", {}, spec, reqs, 16, kernels="fp8") == {"runner": {"kernels": "fp8"}}
    assert bench.server_overrides("naive", base, spec, reqs, 16, kernels="fp8")["runner"]["kernels"] == "eager"
    # --compile-decode: the step and planned servers compile their decode; the naive one stays what a user runs
    assert bench.server_overrides("step", {}, spec, reqs, 16, kernels="compiled", compile_decode=True) == {
        "runner": {"kernels": "compiled", "compile_decode": True}}
    assert "compile_decode" not in bench.server_overrides("naive", base, spec, reqs, 16, compile_decode=True)["runner"]
    validated_requests, refused = bench.validate_all(RequestValidator(cfgs["step"], spec, counter), reqs, 20)
    assert refused == [] and all(p.lookup.hit for p in validated_requests)
    # the cached server: the step server whose every request takes --cache (the tiny default takes a step cache)
    assert over["cached"] == {"runner": {"kernels": "eager"}, "cache": {"default": {"method": "first_block",
                                                                                    "threshold": 0.4}}}
    cached = bench.validate_all(RequestValidator(cfgs["cached"], spec, counter), reqs, 20)[0]
    assert all(p.request.cache.threshold == 0.4 for p in cached)
    with pytest.raises(ValueError, match="--cache"):
        bench.server_overrides("cached", base, spec, reqs, 16)


def test_naive_tier_of_a_binned_family_is_a_bin_no_request_is_binned_to():
    """PixArt-Sigma 512 (its spec as the family describes it: grid-keyed, masked text, the 512 bins): the
    step table is the replay's bins, the naive tier an unused bin; the real validator checks both."""
    from bcg_core.families.base import ModelSpec
    from bcg_core.families.pixart import aspect_ratio_bins
    from bcg_core.table import ShapeRules
    from bcg_core.validation import RequestValidator
    from deployments.settings import ServeConfig

    spec = ModelSpec("pixart-512", "pixart", "PixArtSigmaPipeline", ShapeRules(16, True, None),
                     size_bins=aspect_ratio_bins(64), max_text_tokens=300)

    def count(prompt, negative=False):
        return len(prompt.split()) + 1

    reqs = bench.replay_requests(32)
    base, _, cfgs = _configs({"path": None}, spec, count, reqs)
    assert set(base["buckets"]["resolutions"]) == {"512x512", "416x608", "608x416", "576x416", "448x544",
                                                   "704x352", "800x320"}
    need = max(count(r.prompt) for r in reqs)
    assert base["buckets"]["text_lengths"] == [min(t for t in bench.TEXT_BUCKETS if t >= need)]
    tier = cfgs["naive"].buckets.resolutions[0]
    assert tier not in base["buckets"]["resolutions"]
    assert bench.check_all_miss(RequestValidator(cfgs["naive"], spec, count), reqs, 20) == []
    validated_requests, refused = bench.validate_all(RequestValidator(cfgs["step"], spec, count), reqs, 20)
    assert refused == [] and all(p.lookup.hit for p in validated_requests)
    forced = bench.replay_requests(4, size="512x512")  # --size: one bin for every request
    assert {(r.width, r.height) for r in forced} == {(512, 512)}
    assert bench.base_config({"path": None}, spec, count, forced, 20)["buckets"]["resolutions"] == ["512x512"]
    ServeConfig.model_validate(base)


# -- summary and ratios ----------------------------------------------------------------------------------------


def _row(ok=True, status=200, ms=100.0, images=2, hit=True, retries=0):
    return {"ok": ok, "status": status, "latency_ms": ms, "images": images if ok else 0, "hit": hit if ok else None,
            "retries": retries}


def test_summary_counts_failures_and_computes_throughput_latency_and_floor_ratios():
    rows = [_row(ms=100), _row(ms=200, retries=2), _row(ms=300, hit=False), _row(ms=400),
            _row(False, 422, 5), _row(False, 503, 9), _row(False, None, 10)]
    s = bench.summarize(rows, wall_s=2.0, floor_s=0.5)
    assert (s["requests"], s["ok"], s["failures"]) == (7, 4, 3)
    assert (s["http_4xx"], s["http_5xx"], s["no_answer"], s["retries"]) == (1, 1, 1, 2)
    assert s["images"] == 8 and s["images_per_s"] == 4.0 and s["requests_per_s"] == 2.0
    assert s["latency_ms"] == {"p50": 250.0, "p99": 397.0, "mean": 250.0, "max": 400.0}  # ok requests only
    assert (s["hits"], s["misses"]) == (3, 1)
    assert s["wall_over_floor"] == 4.0 and s["floor_share"] == 0.25
    s = bench.summarize([_row(retries=None)], wall_s=1.0)
    assert s["retries"] is None and s["floor_s"] is None and s["wall_over_floor"] is None


def test_ratios_against_naive():
    r = bench.ratios({"naive": {"images_per_s": 2.0, "c1_p50_ms": 1000.0},
                      "step": {"images_per_s": 7.0, "c1_p50_ms": 880.0},
                      "planned": {"images_per_s": 8.4, "c1_p50_ms": 800.0}})
    assert r["images_per_s_vs_naive"] == {"step": 3.5, "planned": 4.2}
    assert r["c1_vs_naive"] == {"step": 0.88, "planned": 0.8} and r["planned_vs_step"] == 1.2
    r = bench.ratios({"naive": {"images_per_s": 2.0}, "step": None})  # a failed server, planned not run
    assert r["images_per_s_vs_naive"] == {"step": None} and r["c1_vs_naive"] == {"step": None}
    r = bench.ratios({"naive": {"images_per_s": 2.0, "failures": 0},
                      "planned": {"images_per_s": 5.6, "failures": 17, "c1_p50_ms": None}})
    assert r["images_per_s_vs_naive"] == {"step": None, "planned": None}  # 15 of 32 served: not comparable


def test_half_cached_requests_and_the_others_latency():
    """The half-cached server: even-numbered requests carry the cache in their body, odd ones none; every server
    reports the odd ones' latency, and the ratios compare the half-cached server's with the step server's."""
    from deployments.cli.demo_replay import DemoRequest

    cache = {"method": "first_block", "threshold": 0.5}
    reqs = [DemoRequest(i, i - 1, f"p{i}", 512, 512, 1, i) for i in range(1, 5)]
    sent = bench.half_cached(reqs, cache)
    assert [r.body(20).get("cache") for r in sent] == [None, cache, None, cache]
    assert all(r.body(20)["cache"] == cache for r in bench.half_cached(reqs, cache, every=True))
    rows = [{"number": i, "ok": ok, "latency_ms": ms} for i, ok, ms in
            ((1, True, 100.0), (2, True, 50.0), (3, True, 300.0), (4, True, 60.0), (5, False, 1.0))]
    assert bench.others_latency(rows) == {"requests": 2, "p50": 200.0, "p99": 298.0, "mean": 200.0}
    r = bench.ratios({"step": {"images_per_s": 2.0, "others_latency_ms": {"p50": 200.0, "p99": 400.0}},
                      "cached": {"images_per_s": 3.4},
                      "half-cached": {"images_per_s": 2.6, "others_latency_ms": {"p50": 210.0, "p99": 380.0}}})
    assert r["cached_vs_step"] == 1.7 and r["others_latency_vs_step"] == {"p50": 1.05, "p99": 0.95}
    assert bench.server_overrides("half-cached", {}, None, reqs, 16, cache=cache) == {"runner": {"kernels": "eager"}}
    with pytest.raises(ValueError, match="half-cached server needs --cache"):
        bench.server_overrides("half-cached", {}, None, reqs, 16)


def test_small_helpers():
    assert bench.busy_fraction([(0.0, 100.0), (1.0, 50.0), (2.0, 0.0), (9.0, 100.0)], 0.5, 2.5) == 0.25
    assert bench.busy_fraction([(0.0, 100.0)], 1.0, 2.0) is None
    merged = bench.merge({"a": {"x": 1, "y": 2}, "b": 1}, {"a": {"y": 3}, "c": 4})
    assert merged == {"a": {"x": 1, "y": 3}, "b": 1, "c": 4}
    assert bench.parse_servers("step, naive,step") == ["step", "naive"]
    with pytest.raises(ValueError, match="subset"):
        bench.parse_servers("naive,fast")
    assert bench.gpu_label("NVIDIA H200") == "h200" and bench.gpu_label("NVIDIA H100 80GB HBM3") == "h100"
    assert bench.gpu_label(None) == "cpu"
    reqs = bench.replay_requests(4)
    warm = bench.warmup_requests(reqs, "shapes")
    assert len({(r.width, r.height, r.n) for r in warm}) == len(warm) and warm[0].number == 10001
    assert bench.warmup_requests(reqs, "none") == [] and len(bench.warmup_requests(reqs, "first")) == 1
    c1 = bench.c1_requests(reqs, 3)
    assert [r.number for r in c1] == [20001, 20002, 20003] and {(r.prompt, r.seed) for r in c1} == {
        (reqs[0].prompt, reqs[0].seed)}
    assert bench.GpuSampler().active is (bench.GpuSampler().source is not None)


def test_gentd26_mix_keeps_krea_prompts_sizes_and_seeds_with_the_traces_image_counts(tmp_path):
    """``--mix gentd26``: each request's image count is drawn from the trace's text-to-image rows (seeded, so
    every server replays the same requests), the rest is krea's; a trace of one count gives that count; a trace
    without text-to-image rows and an unknown mix are errors."""
    krea = bench.replay_requests(32)
    mixed = bench.replay_requests(32, mix="gentd26")
    assert ([(r.prompt, r.width, r.height, r.seed) for r in mixed]
            == [(r.prompt, r.width, r.height, r.seed) for r in krea])
    assert mixed == bench.replay_requests(32, mix="gentd26") != bench.replay_requests(32, mix="gentd26", mix_seed=1)
    assert {r.n for r in mixed} <= {1, 2, 4, 8} and sum(r.n == 1 for r in mixed) > sum(r.n == 1 for r in krea)
    head = "predict_type,num_images_per_prompt,num_inference_steps,prompt_length\n"
    one = tmp_path / "one.csv"
    one.write_text(head + "TXT_2_IMG,4.0,30,20\nIMG_2_IMG,8.0,30,20\nTXT_2_IMG,,30,20\n")
    assert {r.n for r in bench.replay_requests(5, mix="gentd26", trace=str(one))} == {4}
    edits = tmp_path / "edits.csv"
    edits.write_text(head + "IMG_2_IMG,8.0,30,20\n")
    with pytest.raises(ValueError, match="no TXT_2_IMG row"):
        bench.replay_requests(5, mix="gentd26", trace=str(edits))
    with pytest.raises(ValueError, match="mix must be"):
        bench.replay_requests(5, mix="parti")
    with pytest.raises(ValueError, match="mix_draw must be"):
        bench.replay_requests(5, mix="gentd26", mix_draw="stratified")
    # --mix-draw quota: the trace's shares up to rounding, whatever the seed; only the order moves
    shares = tmp_path / "shares.csv"
    shares.write_text(head + "TXT_2_IMG,1.0,30,20\n" * 58 + "TXT_2_IMG,2.0,30,20\n" * 8 + "TXT_2_IMG,4.0,30,20\n" * 19
                      + "TXT_2_IMG,8.0,30,20\n" * 14 + "TXT_2_IMG,5.0,30,20\n")  # 100 rows: 58/8/19/14/1%
    quota = [[r.n for r in bench.replay_requests(32, mix="gentd26", trace=str(shares), mix_seed=s, mix_draw="quota")]
             for s in (0, 1)]
    # shares of 32: 18.56 / 2.56 / 6.08 / 4.48 / 0.32, floors 18 + 2 + 6 + 4 + 0 = 30; the two largest remainders
    # (n=1 and n=2, .56 each, above n=8's .48) get one more
    assert sorted(quota[0]) == sorted(quota[1]) and quota[0] != quota[1]
    assert {c: quota[0].count(c) for c in (1, 2, 4, 8, 5)} == {1: 19, 2: 3, 4: 6, 8: 4, 5: 0}
    # the planned server plans for the same kind of traffic: the trace joined with krea's sizes
    from deployments.settings import ServeConfig

    base = ServeConfig().model_dump(mode="json")
    planned = bench.planned_buckets(base, 4, 4, source=f"gentd26:{one}")
    # every trace request asks for 4 images: 8 rows with classifier-free guidance, never krea's 9-image rows
    assert planned["plan"]["source"].startswith("gentd26") and max(planned["batch_sizes"]) == 8
