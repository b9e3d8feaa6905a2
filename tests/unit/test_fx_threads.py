"""torch.fx's tracing patches stay on the tracing thread (bcg_core/runners/fx_threads.py): a module called on another
thread while a trace runs (a request served beside a background compile) runs as usual."""

import threading

import torch

from bcg_core.runners.fx_threads import isolate_fx_patches


class _Traced(torch.nn.Module):
    """Its forward holds the trace open until the other thread has called its module."""

    def __init__(self, tracing: threading.Event, called: threading.Event):
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)
        self.tracing, self.called = tracing, called

    def forward(self, x):
        self.tracing.set()
        assert self.called.wait(10)
        return self.lin(x)


def _call_beside_a_trace() -> tuple[list, torch.fx.GraphModule]:
    """Trace ``_Traced`` on this thread while another thread calls an unrelated module; the other thread's errors
    and outputs, and the traced module."""
    tracing, called = threading.Event(), threading.Event()
    other, seen = torch.nn.Linear(2, 2), []

    def serve():
        assert tracing.wait(10)
        try:
            seen.append(other(torch.ones(1, 2)))
        except Exception as e:  # noqa: BLE001 - what the assertion looks at
            seen.append(e)
        finally:
            called.set()

    thread = threading.Thread(target=serve)
    thread.start()
    traced = torch.fx.symbolic_trace(_Traced(tracing, called))
    thread.join(10)
    return seen, traced


def test_without_isolation_a_module_called_beside_a_trace_raises_and_with_it_runs():
    was_on = hasattr(torch.fx._symbolic_trace._Patcher, "_bcg_torch_methods")  # another test installed it
    isolate_fx_patches(False)
    try:
        seen, _ = _call_beside_a_trace()  # torch as it ships: the failure a served request met
        assert len(seen) == 1 and isinstance(seen[0], NameError), seen

        assert isolate_fx_patches() and isolate_fx_patches()  # idempotent
        seen, traced = _call_beside_a_trace()
        assert len(seen) == 1 and isinstance(seen[0], torch.Tensor) and seen[0].shape == (1, 2), seen
        # the tracing thread still traced as torch does: the submodule is a call_module node
        assert [n.op for n in traced.graph.nodes] == ["placeholder", "call_module", "output"]
        assert torch.nn.Module.__call__ is torch.nn.Module._wrapped_call_impl  # reverted after the trace
    finally:
        isolate_fx_patches(was_on)
