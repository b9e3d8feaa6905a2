"""DiTPipeline.generate (the synchronous path for tests and scripts) and what the one step interface guarantees.

``generate`` drives the same start -> step -> finish hooks as the step scheduler, in the forwards the pipeline's
decider chooses; the images must equal the family's hooks written out by hand, bit for bit. Only a
:class:`~bcg_core.request.ValidatedRequest` is accepted below the validator (validated once).
"""

import asyncio
import sys
import threading

import pytest
import torch

from bcg_core import (
    BucketConfig,
    BucketKey,
    DiTPipeline,
    GenerationRequest,
    RequestError,
    StepScheduler,
    build_tiny,
)
from bcg_core.config import EngineConfig
from bcg_core.families.tiny import TINY_TEXT_TOKENS
from bcg_core.metrics import token_shares

T = TINY_TEXT_TOKENS
CONFIG = EngineConfig(buckets=BucketConfig(batch_sizes=[1, 2, 4, 8], resolutions=["256x256", "256x512"],
                                          text_lengths=[T]))


@pytest.fixture(scope="module")
def tiny():
    return build_tiny()


@pytest.fixture
def pipe(tiny):
    return DiTPipeline(CONFIG, tiny)  # fresh counters per test


def _req(prompt="a red cube", n=1, width=256, height=256, steps=1, guidance=1.0, seed=0, **kw) -> GenerationRequest:
    return GenerationRequest(prompt, n=n, width=width, height=height, num_inference_steps=steps,
                             guidance_scale=guidance, seed=seed, **kw)


@torch.inference_mode()
def _reference_images(pipe: DiTPipeline, request: GenerationRequest) -> list[bytes]:
    """The single-request path written out from the family's step hooks (start, model_rows, the runner on the
    request's own bucket, advance, decode), without DiTPipeline.step."""
    validated = pipe.validator.validate(request)
    state = pipe.model.start(validated)
    while not state.done:
        pipe.model.advance(state, pipe.runner.run(validated.lookup.key, pipe.model.model_rows(state)))
    return pipe.finish(state)


@pytest.mark.parametrize("guidance", [1.0, 4.0])
def test_generate_is_the_family_hooks_bit_for_bit(pipe, guidance):
    req = _req("a corgi astronaut", n=2, steps=2, guidance=guidance, seed=5, negative_prompt="blurry")
    reference = _reference_images(pipe, req)
    result = pipe.generate(pipe.validator.validate(req))
    assert result.image_bytes == reference
    key = BucketKey(4 if guidance > 1 else 2, 256, T)
    assert result.batch_size == 1 and result.bucket == key and result.hit and result.seed == 5 and result.steps == 2
    assert result.real_tokens == result.padded_tokens == key.tokens
    assert result.to_dict()["bucket"] == str(key)
    assert pipe.metrics.counters(key).requests == 1


def test_generate_and_the_scheduler_take_only_a_validated_request_and_trust_it(pipe, monkeypatch):
    validated = pipe.validator.validate(_req(seed=3))
    calls = []
    real = pipe.validator.validate
    monkeypatch.setattr(pipe.validator, "validate", lambda r: calls.append(r) or real(r))
    assert pipe.generate(validated).image_bytes == pipe.generate(pipe.validator.validate(_req(seed=3))).image_bytes
    assert len(calls) == 1  # the caller's own validation only: a validated request is trusted, never validated again
    with pytest.raises(TypeError, match=r"ValidatedRequest.*pipe\.validator\.validate\(request\)"):
        pipe.generate(_req(seed=3))  # a raw request is refused, not validated on a second path
    assert len(calls) == 1
    with pytest.raises(RequestError) as info:
        pipe.validator.validate(_req(width=250))
    assert info.value.field == "size"
    sched = StepScheduler(pipe)
    try:
        async def main():
            with pytest.raises(TypeError, match="ValidatedRequest"):
                await sched.submit(_req())

        asyncio.run(main())
        assert sched.queue_lengths() == {} and sched.stats()["waiting"] == 0
    finally:
        sched.close()


def test_token_shares_split_by_rows_and_sum_exactly():
    assert token_shares(4096, [2, 4]) == [1365, 2731]
    assert token_shares(10, [1, 1, 1]) == [4, 3, 3]
    assert token_shares(7, [3]) == [7]
    assert sum(token_shares(8 * 512, [2, 2, 2])) == 8 * 512
    with pytest.raises(ValueError):
        token_shares(5, [])
    with pytest.raises(ValueError):
        token_shares(5, [2, 0])


def test_validating_while_requests_encode_in_other_threads_does_not_break_the_tokenizer(pipe):
    """A fast tokenizer's padding and truncation are mutable state: counting tokens (the validator, on the
    event loop) while another thread encodes (padding to the text length) made one of them fail."""
    stop, errors = threading.Event(), []

    def validate():
        while not stop.is_set():
            try:
                assert pipe.validator.validate(_req("a lighthouse at dusk, oil on canvas")).prompt_tokens == 10
            except Exception as e:  # noqa: BLE001
                errors.append(e)

    def encode():
        try:
            for _ in range(20):
                rows = pipe.model.encode("a lighthouse")
                assert rows.text.shape[:2] == (1, T)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    validators = [threading.Thread(target=validate)]
    encoders = [threading.Thread(target=encode) for _ in range(2)]  # two requests starting at once
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # the spinning validator hands the GIL back at once after each torch op
    try:
        for t in encoders + validators:
            t.start()
        for t in encoders:
            t.join()
    finally:
        stop.set()
        for t in validators:
            t.join()
        sys.setswitchinterval(interval)
    assert not errors, errors[:3]
