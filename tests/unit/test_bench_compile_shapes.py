"""``benchmarks/bench_compile_shapes.py``'s ``batch`` mode: which inputs get their batch dimension marked dynamic
(the GPU measurement itself runs on the GPU machine; its CPU smoke is the script with ``--device cpu``)."""


import torch

from benchmark_scripts import load

bench = load("bench_compile_shapes")


def test_batch_dynamic_marks_the_batch_dimension_of_batched_inputs_only(monkeypatch):
    marked = []
    monkeypatch.setattr(torch._dynamo, "maybe_mark_dynamic", lambda t, dim: marked.append((tuple(t.shape), dim)))
    calls = []
    forward = bench.batch_dynamic(lambda *a, **k: calls.append((a, k)) or "out")
    hidden, text, temb, rope = torch.zeros(4, 16, 8), torch.zeros(4, 6, 8), torch.zeros(4, 8), torch.zeros(22, 8)
    assert forward(hidden_states=hidden, encoder_hidden_states=text, temb=temb, image_rotary_emb=rope) == "out"
    # the rotary table (tokens x channels) has no batch dimension: its first size is the token count
    assert marked == [((4, 16, 8), 0), ((4, 6, 8), 0), ((4, 8), 0)] and len(calls) == 1
    marked.clear()
    forward(torch.zeros(1, 16, 8), temb=torch.zeros(1, 8))  # one row: dynamo specializes a size of 1 anyway
    assert marked == []
