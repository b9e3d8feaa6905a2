"""A spy on ``Planner.plan``: which planner planned how many requests (proves a plan is never redone)."""

from bcg_core import Planner


class PlanCounter:
    """Records the planner of every ``Planner.plan`` call; the real method still runs.

    Args:
        monkeypatch: pytest's fixture; the wrapper is removed when the test ends.
    """

    def __init__(self, monkeypatch):
        self.calls: list[Planner] = []
        real = Planner.plan

        def counting(planner, request):
            self.calls.append(planner)
            return real(planner, request)

        monkeypatch.setattr(Planner, "plan", counting)

    def by(self, planner: Planner) -> int:
        """Calls made on ``planner``."""
        return sum(p is planner for p in self.calls)
