"""CUDA graph runner on a real GPU: replay equals eager at every boundary, counters, isolation, failures."""

import pytest
import torch

from bcg_core import LimitsConfig, RunMode, ShapeQuery
from bcg_core.runners.cuda_graph import CudaGraphRunner, capture_order
from bcg_core.verify import verify_runner
from bcg_core.verify_inputs import BoundaryCase, boundary_cases, random_inputs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

BF16_RTOL = 2e-2
CUDA = torch.device("cuda")


def _runner(adapter, table, metrics, **kw):
    r = CudaGraphRunner(adapter, table.keys, metrics, CUDA, torch.bfloat16, **kw)
    r.prepare()
    return r


@pytest.fixture(scope="module")
def runner(adapter, table):
    from bcg_core import BucketMetrics

    return _runner(adapter, table, BucketMetrics(table.keys))


def _case(table, rows, grid):
    key = table.lookup(ShapeQuery(rows, grid[0] * grid[1], 64)).key
    return BoundaryCase(key, rows, grid, 64)


def test_every_bucket_is_captured_largest_first_into_one_pool(runner, table):
    assert runner.graph_count == len(table.keys)
    order = list(runner.entries)
    assert order == capture_order(table.keys)
    assert runner.stats.failed == runner.stats.dropped_oom == runner.stats.over_budget == 0
    # Shared pool: the first (largest) capture pays; the rest reuse its blocks.
    largest = runner.entries[order[0]].pool_bytes
    assert runner.stats.pool_bytes <= 1.25 * largest + (2 << 20)


def test_graph_replay_equals_eager_at_every_boundary_shape(adapter, runner, table):
    cases = boundary_cases(table, LimitsConfig())
    verdicts = verify_runner(adapter, runner, cases, CUDA, torch.bfloat16, rtol=BF16_RTOL)
    assert [v.key for v in verdicts] == table.keys
    assert all(v.passed for v in verdicts), [(str(v.key), v.max_rel_err) for v in verdicts if not v.passed]


def test_exact_fit_replay_equals_eager_bit_for_bit(adapter, runner, table):
    """Unmasked buckets at exactly their size run the same kernels as eager: identical bits."""
    for key in (k for k in table.keys if not k.image_mask):
        grid = (16, 16) if key.image_tokens == 256 else (32, 32)
        case = BoundaryCase(key, key.batch, grid, 64)
        x = random_inputs(adapter, case, CUDA, torch.bfloat16, seed=key.batch)
        with torch.inference_mode():
            ref = adapter.forward_eager(x)
        assert torch.equal(runner.run(key, x), ref), str(key)


def test_the_expected_buckets_replay_counter_goes_up_and_captures_stay_constant(adapter, runner, table):
    captures = (runner.graph_count, runner.stats.captured, runner.stats.lazy_captures)
    case = _case(table, 3, (16, 20))
    before = runner.entries[case.key].forwards
    others = {k: e.forwards for k, e in runner.entries.items() if k != case.key}
    for _ in range(3):
        runner.run(case.key, random_inputs(adapter, case, CUDA, torch.bfloat16))
    assert runner.entries[case.key].forwards == before + 3
    assert runner.entries[case.key].mode is RunMode.GRAPH
    assert {k: e.forwards for k, e in runner.entries.items() if k != case.key} == others
    assert (runner.graph_count, runner.stats.captured, runner.stats.lazy_captures) == captures


def test_output_of_a_is_unchanged_after_b_replays(adapter, runner, table):
    a = _case(table, 2, (16, 16))
    b = BoundaryCase(a.key, 2, (16, 16), 64)
    out_a = runner.run(a.key, random_inputs(adapter, a, CUDA, torch.bfloat16, seed=1))
    kept = out_a.clone()
    out_b = runner.run(b.key, random_inputs(adapter, b, CUDA, torch.bfloat16, seed=2))
    assert torch.equal(out_a, kept)
    assert not torch.equal(out_a, out_b)
    assert out_a.data_ptr() != runner.entries[a.key].output.data_ptr()


def test_cfg_cond_and_uncond_rows_in_one_graph_match_separate_eager_runs(adapter, runner, table):
    n = 2
    cond = random_inputs(adapter, _case(table, n, (32, 32)), CUDA, torch.bfloat16, seed=5)
    uncond = random_inputs(adapter, _case(table, n, (32, 32)), CUDA, torch.bfloat16, seed=6)
    both = type(cond)(torch.cat([cond.latents, cond.latents]), torch.cat([cond.text, uncond.text]),
                      torch.cat([cond.pooled, uncond.pooled]), torch.cat([cond.timestep, cond.timestep]), cond.grid)
    key = table.lookup(ShapeQuery(2 * n, 1024, 64)).key
    out = runner.run(key, both)
    c, u = out.chunk(2)
    assert c.data_ptr() != u.data_ptr()
    with torch.inference_mode():
        ref_c = adapter.forward_eager(cond.__class__(cond.latents, cond.text, cond.pooled, cond.timestep, cond.grid))
        ref_u = adapter.forward_eager(cond.__class__(cond.latents, uncond.text, uncond.pooled, cond.timestep,
                                                     cond.grid))
    for got, ref in ((c, ref_c), (u, ref_u)):
        assert ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item() < BF16_RTOL
    assert not torch.allclose(c, u)


class _SyncingAdapter:
    """Wraps an adapter; its forward hides a host sync (``.item()``), which capture must refuse."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def forward(self, buffers):
        if buffers["timestep"].sum().item() > 1e9:
            raise AssertionError("unreachable")
        return self.inner.forward(buffers)


class _OomAdapter(_SyncingAdapter):
    """Raises CUDA out-of-memory whenever a capture is under way."""

    def forward(self, buffers):
        if torch.cuda.is_current_stream_capturing():
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated during capture)")
        return self.inner.forward(buffers)


def test_a_capture_that_raises_marks_its_bucket_eager_only_and_serving_continues(adapter, table, metrics):
    r = _runner(_SyncingAdapter(adapter), table, metrics)
    assert r.graph_count == 0 and r.stats.failed == len(table.keys)
    entry = next(iter(r.entries.values()))
    assert entry.mode is RunMode.STATIC_EAGER and "capture_failed" in entry.note
    v = verify_runner(adapter, r, boundary_cases(table, LimitsConfig())[:4], CUDA, torch.bfloat16, rtol=BF16_RTOL)
    assert all(x.passed for x in v)


def test_out_of_memory_during_capture_drops_the_bucket_and_serving_continues(adapter, table, metrics):
    r = _runner(_OomAdapter(adapter), table, metrics)
    assert r.graph_count == 0 and r.stats.dropped_oom == len(table.keys)
    assert all("dropped" in d["mode"] for d in r.describe())
    v = verify_runner(adapter, r, boundary_cases(table, LimitsConfig())[:4], CUDA, torch.bfloat16, rtol=BF16_RTOL)
    assert all(x.passed for x in v)


def test_buckets_beyond_the_budget_are_not_captured_and_are_reported(adapter, table, metrics):
    r = _runner(adapter, table, metrics, budget_bytes=1)
    assert r.graph_count == 0 and r.stats.over_budget == len(table.keys)
    assert all(d["note"].startswith("over_budget") for d in r.describe())
    v = verify_runner(adapter, r, boundary_cases(table, LimitsConfig())[:4], CUDA, torch.bfloat16, rtol=BF16_RTOL)
    assert all(x.passed for x in v)


def test_lazy_capture_is_counted(adapter, table, metrics):
    r = _runner(adapter, table, metrics, lazy=True)
    assert r.graph_count == 0
    case = _case(table, 1, (16, 16))
    r.run(case.key, random_inputs(adapter, case, CUDA, torch.bfloat16))
    r.run(case.key, random_inputs(adapter, case, CUDA, torch.bfloat16))
    assert r.stats.lazy_captures == 1 and r.graph_count == 1




def test_captures_while_another_thread_allocates_and_synchronizes(adapter, table, metrics, monkeypatch):
    """A replica captures shapes it gains while it serves (a peer left; lazy captures); its decode thread, LoRA
    loader and others go on allocating device memory and synchronizing their streams. The start captures half the
    table; then, with another thread allocating 12 MiB blocks (each its own ``cudaMalloc``) and synchronizing its
    stream, the rest. Neither side fails: every bucket is captured and replays equal eager, and the other thread
    sees no error (the capture's error mode is ``thread_local``; under ``global`` a ``cudaMalloc`` elsewhere fails
    during a capture; and the process-wide sync debug mode is left to the first ``prepare``)."""
    import threading
    import time

    stop, capturing, errors, overlaps = threading.Event(), threading.Event(), [], []
    real = CudaGraphRunner._record

    def record(self, *args, **kwargs):
        capturing.set()
        try:
            return real(self, *args, **kwargs)
        finally:
            capturing.clear()

    monkeypatch.setattr(CudaGraphRunner, "_record", record)

    def busy():
        stream, held = torch.cuda.Stream(CUDA), []
        try:
            with torch.cuda.stream(stream):
                while not stop.is_set():
                    if len(held) < 200:  # 12 MiB blocks, never freed: a cudaMalloc each (2.4 GiB at most)
                        held.append(torch.empty(3 * 2**20, device=CUDA).fill_(1.0))
                        if capturing.is_set():
                            overlaps.append(len(held))
                    stream.synchronize()
                    time.sleep(0.002)
        except Exception as e:  # noqa: BLE001 - reported by the test
            errors.append(e)

    keys = capture_order(table.keys)
    r = CudaGraphRunner(adapter, table.keys, metrics, CUDA, torch.bfloat16)  # sync debug on, as a replica's
    r.prepare(keys[: len(keys) // 2])  # the start, before serving
    worker = threading.Thread(target=busy)
    worker.start()
    try:
        r.prepare(keys[len(keys) // 2:])  # shapes gained while serving
    finally:
        stop.set()
        worker.join()
    assert not errors, errors
    assert overlaps  # the other thread did allocate during a capture
    assert r.graph_count == len(table.keys) and r.stats.failed == 0, r.describe()
    v = verify_runner(adapter, r, boundary_cases(table, LimitsConfig())[:6], CUDA, torch.bfloat16, rtol=BF16_RTOL)
    assert all(x.passed for x in v)
