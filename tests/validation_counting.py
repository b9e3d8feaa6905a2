"""A spy on ``RequestValidator.validate``: which validator validated how many requests (proves a validation is never
redone)."""

from bcg_core import RequestValidator


class ValidationCounter:
    """Records the validator of every ``RequestValidator.validate`` call; the real method still runs.

    Args:
        monkeypatch: pytest's fixture; the wrapper is removed when the test ends.
    """

    def __init__(self, monkeypatch):
        self.calls: list[RequestValidator] = []
        real = RequestValidator.validate

        def counting(validator, request):
            self.calls.append(validator)
            return real(validator, request)

        monkeypatch.setattr(RequestValidator, "validate", counting)

    def by(self, validator: RequestValidator) -> int:
        """Calls made on ``validator``."""
        return sum(p is validator for p in self.calls)
