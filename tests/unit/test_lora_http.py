"""LoRA adapters over HTTP without Ray: the ``lora`` field's schema and its mapping onto ``GenerationRequest.lora``,
its type errors, the ingress's check of names against ``lora.dir`` (:class:`deployments.adapters.AdapterCatalog`),
``bcg.lora`` of ``GET /v1/models``, the answers to a replica's refusals (422 naming the field, 503 with
``Retry-After``, neither resent), and the ``bcg_lora_*`` metrics (fake backend). Served for real, on the tiny
default with an adapter: ``tests/serve/test_lora_serve.py``."""

from __future__ import annotations

import asyncio
import json

import pytest
from pydantic import ValidationError
from ray.exceptions import RayTaskError

from bcg_core.errors import RequestError, ServiceUnavailable
from bcg_core.lora.config import LoRAConfig
from deployments.adapters import AdapterCatalog
from deployments.http_errors import validation_error_response
from deployments.metrics import BucketExporter
from deployments.request_args import as_generation_request
from deployments.schemas import ImageGenerationRequest, RequestLimits
from deployments.settings import ServeConfig
from fake_metrics import FakeBackend
from ingress_fakes import FakeDiT, bare_ingress, http_request

BUCKETS = {"batch_sizes": [1, 2], "resolutions": ["256x256"], "text_lengths": [256]}
LIMITS = RequestLimits(lora=LoRAConfig(dir="/nowhere", max_per_request=2, max_scale=3.0))


def _lora_file(path) -> None:
    """A safetensors file whose header names a LoRA weight (all the listing reads; no model reads it here)."""
    import torch
    from safetensors.torch import save_file

    save_file({"transformer.proj_out.lora_A.weight": torch.zeros(1, 1)}, str(path))


def _folder(tmp_path, *names: str, as_file: bool = True):
    loras = tmp_path / "loras"
    loras.mkdir(exist_ok=True)
    for n in names:
        if as_file:
            _lora_file(loras / f"{n}.safetensors")
        else:
            (loras / n).mkdir()
            _lora_file(loras / n / "pytorch_lora_weights.safetensors")
    return loras


def _ingress(dit=None, lora: dict | None = None):
    config = {"buckets": BUCKETS, "routing": {"shape_aware": False}}
    if lora is not None:
        config["lora"] = lora
    return bare_ingress(dit or FakeDiT(), ServeConfig.model_validate(config))


def _error(answer) -> tuple[int, dict]:
    return answer.status_code, json.loads(answer.body)["error"]


def _post(ingress, body: dict):
    return asyncio.run(ingress.generate(http_request({"prompt": "x", "size": "256x256", **body})))


def _schema_error(body: dict, limits: RequestLimits = LIMITS) -> tuple[int, dict]:
    with pytest.raises(ValidationError) as e:
        ImageGenerationRequest.model_validate_json(json.dumps({"prompt": "x", **body}), context={"limits": limits})
    return _error(validation_error_response(e.value, limits))


# -- the schema and its mapping ---------------------------------------------------------------------------------


def test_lora_entries_map_onto_the_engine_request_with_scale_one_by_default():
    req = ImageGenerationRequest.model_validate_json(json.dumps({"prompt": "x", "lora": [
        {"name": "style", "scale": 0.8}, {"name": "ink"}, {"name": "neg", "scale": -1}, {"name": "n", "scale": None}]}))
    assert req.lora_entries() == (("style", 0.8), ("ink", 1.0), ("neg", -1.0), ("n", 1.0))
    assert all(isinstance(s, float) for _, s in req.lora_entries())
    for body in ({}, {"lora": None}, {"lora": []}):
        assert ImageGenerationRequest.model_validate({"prompt": "x", **body}).lora_entries() == ()


@pytest.mark.parametrize("entries,where,says", [
    ([{"name": "a", "scale": "0.5"}], "got '0.5' at lora[0].scale", "valid number"),
    ([{"name": "a", "scale": True}], "got true at lora[0].scale", "valid number"),
    ([{"name": 7}], "got 7 at lora[0].name", "valid string"),
    ([{"name": "a", "weight": 1.0}], "unknown key 'weight' at lora[0]", None),
    ([{"scale": 1.0}], "lora[0].name is missing", None),
    (["a"], "got 'a' at lora[0]: Input should be an object", None),
    ([{"name": "a" * 129}], "at lora[0].name", "at most 128 characters"),
])
def test_a_bad_entry_is_422_naming_the_field_where_and_the_allowed_values(entries, where, says):
    status, err = _schema_error({"lora": entries})
    assert status == 422 and err["param"] == "lora"
    assert err["message"].startswith("invalid 'lora' (") and where in err["message"].split(")")[0], err["message"]
    assert says is None or says in err["message"]
    assert err["message"].endswith("allowed: a list of at most 2 {\"name\": ..., \"scale\": ...} with distinct names "
                                   "of adapters in GET /v1/models and scales from -3 to 3")


def test_too_many_entries_are_refused_by_their_count_before_any_entry_is_read():
    status, err = _schema_error({"lora": [{"name": "a"}, {"name": "b"}, {"name": 3}]})
    assert status == 422 and err["param"] == "lora"
    # not a cut repr of the list, and the count said once
    assert err["message"].startswith("invalid 'lora' (got a list of 3 entries): more entries than "
                                     "lora.max_per_request 2; allowed: ")
    assert "valid string" not in err["message"]  # the entries were not read
    # without a served lora section the schema still reads at most 16
    status, err = _schema_error({"lora": [{"name": "a"}] * 17}, RequestLimits())
    assert status == 422 and "at most 16 items" in err["message"]
    assert "serves no LoRA adapters (lora.dir is unset)" in err["message"]
    status, err = _schema_error({"lora": {"name": "a"}})
    assert status == 422
    assert err["message"].startswith("invalid 'lora' (got {'name': 'a'}): Input should be a valid array")


def test_the_openapi_body_schema_has_the_entries_inline():
    from deployments.ingress import app

    body = app.openapi()["paths"]["/v1/images/generations"]["post"]["requestBody"]["content"]["application/json"]
    text = json.dumps(body["schema"])
    assert "$ref" not in text and "$defs" not in text
    items = next(a for a in body["schema"]["properties"]["lora"]["anyOf"] if a.get("type") == "array")["items"]
    assert items["required"] == ["name"] and items["additionalProperties"] is False


def test_the_python_handle_takes_the_http_entries_too():
    r = as_generation_request({"prompt": "x", "lora": [{"name": "a", "scale": 0.5}, {"name": "b"}, ("c", 2.0)]})
    assert r.lora == (("a", 0.5), ("b", 1.0), ("c", 2.0))
    assert as_generation_request({"prompt": "x", "lora": [("a", 0.5)]}).lora == [("a", 0.5)]  # the validator's to check


# -- the ingress: validation, the check against lora.dir, the model card ----------------------------------------


def test_a_request_with_adapters_is_validated_and_sent_with_them(tmp_path):
    loras = _folder(tmp_path, "style", "ink")
    dit = FakeDiT()
    answer = _post(_ingress(dit, {"dir": str(loras)}), {"lora": [{"name": "style", "scale": 0.5}, {"name": "ink"}]})
    assert len(answer.data) == 1
    (_, validated), = dit.sent
    assert validated.request.lora == (("style", 0.5), ("ink", 1.0))
    said = [{"name": "style", "scale": 0.5}, {"name": "ink", "scale": 1.0}]  # bcg.lora: as applied, defaults filled
    assert [a.model_dump() for a in answer.bcg.lora] == said
    from bcg_core.pipeline import GenerationResult
    from deployments.answers import bcg_info  # what a streamed answer's completed events carry too

    result = GenerationResult(image_bytes=[], seed=1, bucket=None, hit=False, missed=[], real_tokens=1, padded_tokens=1,
                              steps=1, timings_ms={})
    assert [a.model_dump() for a in bcg_info(result, {}, 0, validated).lora] == said


def test_the_validator_refuses_adapters_where_none_are_served():
    dit = FakeDiT()
    status, err = _error(_post(_ingress(dit), {"lora": [{"name": "style"}]}))
    assert status == 422 and err["param"] == "lora" and not dit.sent
    assert "this deployment serves no LoRA adapters" in err["message"]
    status, err = _error(_post(_ingress(dit, {"dir": "/x", "max_per_request": 2, "max_scale": 2.0}),
                               {"lora": [{"name": "a", "scale": 2.5}]}))
    assert status == 422 and err["param"] == "lora" and "out of range" in err["message"] and not dit.sent


def test_an_unknown_adapter_is_422_listing_the_adapters_and_never_reaches_a_replica(tmp_path):
    loras = _folder(tmp_path, "style")
    _folder(tmp_path, "ink", as_file=False)
    dit = FakeDiT()
    ingress = _ingress(dit, {"dir": str(loras)})
    status, err = _error(_post(ingress, {"lora": [{"name": "style"}, {"name": "nope"}]}))
    assert status == 422 and err["param"] == "lora" and not dit.sent
    assert err["message"].startswith("invalid 'lora': no adapter 'nope' in lora.dir (adapters: ink, "
                                     "style; GET /v1/models lists them); allowed: a list of at most 4")
    # streamed too: a plain 422, not an error event after a 200
    status, err = _error(_post(ingress, {"lora": [{"name": "nope"}], "stream": True, "partial_images": 1}))
    assert status == 422 and err["param"] == "lora" and not dit.sent
    with pytest.raises(RequestError, match="no adapter 'nope'") as e:  # the Python handle
        asyncio.run(ingress.images({"prompt": "x", "width": 256, "height": 256, "lora": [("nope", 1.0)]}))
    assert e.value.field == "lora" and not dit.sent


def test_a_link_out_of_lora_dir_is_422_saying_so_not_an_unknown_name(tmp_path):
    """A name whose file is a link that leaves the folder is never served (nor listed); the 422 says that, not
    that the name does not exist."""
    import os

    loras = _folder(tmp_path, "style")
    (tmp_path / "shared.safetensors").write_bytes(b"x")
    os.symlink(tmp_path / "shared.safetensors", loras / "outlink.safetensors")
    dit = FakeDiT()
    status, err = _error(_post(_ingress(dit, {"dir": str(loras)}), {"lora": [{"name": "outlink"}]}))
    assert status == 422 and err["param"] == "lora" and not dit.sent
    assert "adapter 'outlink' links outside lora.dir: a link that leaves the folder is not served (adapters: " \
           "style;" in err["message"], err["message"]
    status, err = _error(_post(_ingress(dit, {"dir": str(loras)}), {"lora": [{"name": "nope"}, {"name": "outlink"}]}))
    assert status == 422 and "links outside lora.dir: a link that leaves the folder is not served; no adapter " \
                             "'nope' in lora.dir (adapters: style;" in err["message"], err["message"]


def test_names_are_read_again_at_most_every_few_seconds_and_a_new_file_passes_at_once(tmp_path):
    loras = _folder(tmp_path, "style")
    now = [0.0]
    catalog = AdapterCatalog(loras, relist_s=5.0, clock=lambda: now[0])
    catalog.refresh()
    assert catalog.listings == 1 and catalog.describe()["adapters"] == ["style"]

    async def check(*names):
        await catalog.check(tuple((n, 1.0) for n in names))

    for _ in range(5):  # known names: no file access
        asyncio.run(check("style"))
        with pytest.raises(RequestError, match="no adapter 'a', 'b' in lora.dir"):
            asyncio.run(check("a", "style", "b"))
    assert catalog.listings == 1  # misses within relist_s did not list the folder again
    _folder(tmp_path, "fresh")
    asyncio.run(check("fresh"))  # found by its path before the next listing
    now[0] = 6.0
    with pytest.raises(RequestError, match=r"adapters: fresh, style;"):
        asyncio.run(check("gone"))
    assert catalog.listings == 2


def test_a_folder_the_ingress_cannot_read_leaves_the_check_to_the_replicas(tmp_path):
    dit = FakeDiT()
    ingress = _ingress(dit, {"dir": str(tmp_path / "missing")})
    _post(ingress, {"lora": [{"name": "style"}]})
    assert dit.sent[0][1].request.lora == (("style", 1.0),)
    card = ingress._model_card().bcg["lora"]
    assert card["adapters"] == [] and "cannot be read by the ingress" in card["error"]


def test_the_model_card_lists_the_adapters_and_the_limits(tmp_path):
    assert _ingress()._model_card().bcg["lora"] is None
    loras = _folder(tmp_path, "b-style", "a.style", ".hidden", "bad name")
    (loras / "notes.txt").write_text("x")
    _folder(tmp_path, "c_dir", as_file=False)
    (loras / "empty_dir").mkdir()
    ingress = _ingress(lora={"dir": str(loras), "slots": 6, "max_rank": 32, "max_per_request": 3, "max_scale": 2.0})
    card = asyncio.run(ingress.models(http_request({}))).data[0].bcg["lora"]
    assert card == {"adapters": ["a.style", "b-style", "c_dir"], "truncated": False, "error": None, "slots": 6,
                    "max_rank": 32, "max_per_request": 3, "max_scale": 2.0, "default_scale": 1.0}
    catalog = AdapterCatalog(loras, max_listed=2)
    catalog.refresh()
    assert catalog.describe() == {"adapters": ["a.style", "b-style"], "truncated": True, "error": None}


def test_the_adapter_list_is_sorted_by_name_and_names_each_adapter_once(tmp_path):
    """``a/`` (diffusers' folder layout) and ``a.safetensors`` are one adapter, even with ``a-b.safetensors``
    sorting between their paths; upper case sorts before lower case, as Python sorts strings."""
    from bcg_core.lora.files import list_names

    loras = _folder(tmp_path, "a", "a-b", "Z")
    _folder(tmp_path, "a", "B", as_file=False)
    assert list_names(loras, 10) == ["B", "Z", "a", "a-b"]
    assert list_names(loras, 2) == ["B", "Z"]


def test_files_that_are_not_lora_weights_are_not_listed_but_refused_by_the_replica(tmp_path):
    """A model's own weights, a text file and an empty file with the ``.safetensors`` suffix are not listed (the
    header names no LoRA weight); a file rewritten into an adapter is listed on the next listing."""
    import torch
    from safetensors.torch import save_file

    from bcg_core.lora.files import list_names

    loras = _folder(tmp_path, "style")
    save_file({"transformer_blocks.0.attn.to_q.weight": torch.zeros(2, 2)}, str(loras / "model.safetensors"))
    (loras / "notes.safetensors").write_text("not a safetensors file")
    (loras / "empty.safetensors").write_bytes(b"")
    (loras / "kohya.safetensors").write_bytes(b"")
    assert list_names(loras, 10) == ["style"]
    save_file({"lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight": torch.zeros(1, 2)},
              str(loras / "kohya.safetensors"))
    assert list_names(loras, 10) == ["kohya", "style"]
    catalog = AdapterCatalog(loras)
    catalog.refresh()
    assert catalog.describe()["adapters"] == ["kohya", "style"]
    asyncio.run(catalog.check((("model", 1.0),)))  # it has a file: the replica reads it and decides (422)


def test_a_file_that_cannot_be_opened_for_a_moment_is_asked_again(tmp_path, monkeypatch):
    import safetensors

    from bcg_core.lora.files import list_names

    loras = _folder(tmp_path, "later")
    real = safetensors.safe_open

    def busy(*a, **k):
        raise OSError(24, "Too many open files")

    monkeypatch.setattr(safetensors, "safe_open", busy)
    assert list_names(loras, 10) == []
    monkeypatch.setattr(safetensors, "safe_open", real)
    assert list_names(loras, 10) == ["later"]  # the failure was not kept for this version of the file


# -- the replica's refusals -------------------------------------------------------------------------------------


class _RefusingDiT(FakeDiT):
    """A DiT handle whose replica refuses with ``error``, wrapped as Ray wraps a replica's exception."""

    def __init__(self, error: Exception):
        super().__init__()
        self.error = error

    async def remote(self, validated):
        self.sent.append((self._shape, validated))
        raise RayTaskError("generate", "Traceback ...", self.error).as_instanceof_cause()


def test_a_replica_refusing_an_adapter_file_is_422_naming_lora_and_not_resent(tmp_path):
    loras = _folder(tmp_path, "broken")
    dit = _RefusingDiT(RequestError("lora", "lora: adapter 'broken' (broken.safetensors) is not a LoRA file "
                                            "diffusers can read: header too large"))
    status, err = _error(_post(_ingress(dit, {"dir": str(loras)}), {"lora": [{"name": "broken"}]}))
    assert (status, err["param"], err["type"]) == (422, "lora", "invalid_request_error")
    assert err["message"].startswith("lora: adapter 'broken'") and len(dit.sent) == 1


def test_a_replica_out_of_adapter_slots_is_503_with_retry_after_and_not_resent(tmp_path):
    loras = _folder(tmp_path, "style")
    dit = _RefusingDiT(ServiceUnavailable("lora", "adapters ['style'] were not loaded within lora.load_timeout_s "
                                                  "(30 s): every slot is in use; retry", retry_after_s=3.0))
    answer = _post(_ingress(dit, {"dir": str(loras)}), {"lora": [{"name": "style"}]})
    status, err = _error(answer)
    assert (status, err["param"], err["type"]) == (503, "lora", "server_error")
    assert answer.headers["retry-after"] == "3" and "every slot is in use" in err["message"] and len(dit.sent) == 1


# -- metrics ----------------------------------------------------------------------------------------------------


def _lora_stats(adapters: dict, resident=None, pinned=None) -> dict:
    return {"buckets": [], "misses": {}, "lora": {"slots": 2, "resident": resident or {}, "pinned": pinned or {},
                                                   "adapters": adapters}}


def _counts(requests=0, hits=0, loads=0, load_s=0.0, evictions=0, refused=0, timeouts=0, cancelled=0) -> dict:
    return dict(requests=requests, hits=hits, loads=loads, load_s=load_s, evictions=evictions, refused=refused,
                timeouts=timeouts, cancelled=cancelled)


def test_adapter_counters_are_exported_only_for_adapters_in_the_folder():
    from bcg_core.metrics import BucketMetrics

    state = {"stats": _lora_stats({"style": _counts(5, 2, 1, 0.25, timeouts=1, cancelled=1),
                                   "broken": _counts(1, refused=1),
                                   "made-up": _counts(1, refused=1)}, {"style": 1}, {"style": 2})}
    asked: list[str] = []

    def exists(name):
        asked.append(name)
        return name != "made-up"

    backend = FakeBackend()
    ex = BucketExporter(lambda: state["stats"], BucketMetrics([]), backend=backend, adapter_exists=exists)
    ex.push()
    m = backend.m
    assert m["bcg_lora_requests"].total(adapter="style") == 5 and m["bcg_lora_hits"].total(adapter="style") == 2
    assert m["bcg_lora_timeouts"].total(adapter="style") == 1 and m["bcg_lora_cancelled"].total(adapter="style") == 1
    assert m["bcg_lora_loads"].total(adapter="style") == 1
    assert m["bcg_lora_load_seconds"].total(adapter="style") == pytest.approx(0.25)
    assert m["bcg_lora_refused"].total(adapter="broken") == 1
    assert not any(t["adapter"] == "made-up" for metric in m.values() if metric.name.startswith("bcg_lora_")
                   for _, t in metric.calls if "adapter" in t)
    assert m["bcg_lora_slots_resident"].total() == 1 and m["bcg_lora_slots_pinned"].total() == 1
    assert sorted(asked) == ["broken", "made-up"]  # a loaded adapter needs no lookup

    state["stats"] = _lora_stats({"style": _counts(7, 4, 1, 0.25, evictions=1, timeouts=1, cancelled=1),
                                  "broken": _counts(1, refused=1),
                                  "made-up": _counts(2, refused=2)})
    ex.push()
    assert m["bcg_lora_requests"].calls[-1] == (2.0, {"adapter": "style"})  # the increase only
    assert m["bcg_lora_evictions"].total(adapter="style") == 1 and m["bcg_lora_slots_resident"].total() == 0
    assert sorted(asked) == ["broken", "made-up"]  # each name looked up once
    # without lora.dir the section is None: nothing exported, nothing fails
    ex2 = BucketExporter(lambda: {"buckets": [], "misses": {}, "lora": None}, BucketMetrics([]), backend=FakeBackend())
    ex2.push()
    assert ex2.status()["errors"] == 0
