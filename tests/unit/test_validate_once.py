"""Validated once: the ingress validates a request, its ValidatedRequest travels to the DiT replica, and the replica
trusts it.

No Ray cluster: the DiT replica and the ingress classes are built outside Serve, the DiT handle is a fake, and
``RequestValidator.validate`` is wrapped to count who validates what.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import pickle

import pytest

from bcg_core import BucketConfig, GenerationRequest, RequestValidator, ValidatedRequest
from deployments.dit import DiTReplica
from deployments.routing import ReplicaUnavailable, call_dit
from deployments.settings import ServeConfig
from ingress_fakes import FakeDiT, bare_ingress, http_request as _http
from validation_counting import ValidationCounter

CONFIG = ServeConfig(buckets=BucketConfig(batch_sizes=[1, 2], resolutions=["256x256"]))
BODY = {"prompt": "a lighthouse at dusk", "n": 1, "size": "256x256", "num_inference_steps": 1,
        "guidance_scale": 0.0}


def _ingress(dit):
    return bare_ingress(dit, CONFIG)


async def _make_replica(config: dict):
    cls = DiTReplica.func_or_class
    replica = cls.__new__(cls)
    await replica.__init__(config)
    return replica


def test_the_replica_trusts_a_validated_request_and_refuses_a_raw_one(monkeypatch):
    ingress_validator = RequestValidator.from_config(CONFIG)
    validated = ingress_validator.validate(  # seed drawn by the ingress
        GenerationRequest("a red cube", width=256, height=256, num_inference_steps=1, guidance_scale=0.0))
    counter = ValidationCounter(monkeypatch)

    async def serve_both():
        replica = await _make_replica(CONFIG.model_dump(mode="json"))
        result = await replica.generate(pickle.loads(pickle.dumps(validated)))  # as it arrives through Ray
        assert counter.calls == []  # neither the scheduler nor the pipeline validated it
        with pytest.raises(TypeError, match="ValidatedRequest"):  # validated once, at the ingress
            await replica.generate({"prompt": "a red cube", "width": 256, "height": 256,
                                    "num_inference_steps": 1, "guidance_scale": 0.0, "seed": validated.request.seed})
        return result

    result = asyncio.run(serve_both())
    assert counter.calls == []
    assert result.seed == validated.request.seed and str(result.bucket) == str(validated.lookup.key) == "b1_i256_t256"


def test_the_ingress_validates_once_sends_the_validated_request_and_names_the_model_from_its_spec(monkeypatch):
    dit = FakeDiT()
    ingress = _ingress(dit)  # FakeDiT.stats raises: the model name must not come from a replica
    counter = ValidationCounter(monkeypatch)
    answer = asyncio.run(ingress.generate(_http({**BODY, "model": "bcg-tiny-flux"})))
    assert answer.bcg.bucket == "b1_i256_t256" and answer.bcg.retries == 0
    assert len(counter.calls) == 1
    (shape, sent), = dit.sent
    assert isinstance(sent, ValidatedRequest) and shape == "i256_t256" == sent.lookup.key.shape
    assert sent.request.seed is not None and answer.bcg.seed == sent.request.seed  # drawn by the ingress
    wrong = asyncio.run(ingress.generate(_http({**BODY, "model": "dall-e-3"})))
    assert wrong.status_code == 422 and json.loads(wrong.body)["error"]["param"] == "model"
    assert "'bcg-tiny-flux'" in json.loads(wrong.body)["error"]["message"]
    bad = asyncio.run(ingress.generate(_http({**BODY, "num_inference_steps": 0})))
    assert bad.status_code == 422 and json.loads(bad.body)["error"]["param"] == "num_inference_steps"
    assert len(dit.sent) == 1  # bad input never reached a replica


def test_the_python_handle_path_sends_the_validated_request_too():
    dit = FakeDiT()
    request = {"prompt": "a red cube", "width": 256, "height": 256, "seed": 5}
    result = asyncio.run(_ingress(dit).images(request))
    (_, sent), = dit.sent
    assert isinstance(sent, ValidatedRequest) and sent.request.seed == 5 and result.seed == 5


def test_a_resend_after_replica_death_carries_the_same_validated_request_and_seed():
    validator = RequestValidator.from_config(CONFIG)
    validated = validator.validate(GenerationRequest("a red cube", width=256, height=256))  # seed drawn here, once
    dit = FakeDiT(fail=2)
    routed = asyncio.run(call_dit(dit, validated, max_retries=2, retry_wait_s=0.0))
    assert routed.retries == 2 and routed.result.seed == validated.request.seed
    assert [s for s, _ in dit.sent] == ["i256_t256"] * 3
    assert all(p == validated for _, p in dit.sent)  # the same validated request each time: same seed, same bucket
    with pytest.raises(ReplicaUnavailable):
        asyncio.run(call_dit(FakeDiT(fail=5), validated, max_retries=1, retry_wait_s=0.0))


def test_a_validated_request_survives_pickling_unchanged():
    validator = RequestValidator.from_config(CONFIG)
    validated = validator.validate(GenerationRequest("a red cube", n=2, width=256, height=256))
    again = pickle.loads(pickle.dumps(validated))
    assert again == validated and dataclasses.asdict(again) == dataclasses.asdict(validated)
