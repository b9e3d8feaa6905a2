"""``/v1/videos`` without Ray: the routes' answers (:class:`deployments.videos.routes.VideoRoutes`) over a real job
store in a temporary folder, a fake DiT deployment that streams step progress and frames
(``ingress_fakes.FakeVideoDiT``) and a validator of a Wan-shaped model built from its shape rules (no checkpoint):
``seconds`` and ``size`` onto the video tiers, create as JSON and as the ``openai`` client's form, every refusal in
OpenAI's error shape, retrieve / list / delete / cancel / content, and a job run by the worker to an MP4 PyAV decodes,
with its progress and a cancel that stops its generation at the DiT."""

from __future__ import annotations

import asyncio
import io
import json

import httpx
import pytest

from bcg_core.errors import RequestError
from bcg_core.families import ModelSpec
from bcg_core.table import ShapeRules
from bcg_core.validation import RequestValidator
from deployments.settings import ServeConfig
from deployments.videos import worker as worker_module
from deployments.videos.options import VideoOptions
from deployments.videos.routes import VideoRoutes, videos_unsupported
from ingress_fakes import FakeVideoDiT, asgi_request

WAN = ShapeRules(pixels_per_token=16, grid_keyed=True, native_text_tokens=512, frame_stride=4)
SPEC = ModelSpec("tiny-wan", "wan", "WanPipeline", WAN, max_prompt_tokens=512, default_steps=50,
                 default_guidance_scale=5.0, default_size=(832, 480), default_frames=81)
BUCKETS = {"batch_sizes": [1], "resolutions": ["48x32", "32x48"], "text_lengths": [512], "frames": [17, 33]}
JSON = [("content-type", "application/json")]


def _config(folder, **videos) -> ServeConfig:
    return ServeConfig.model_validate({"buckets": BUCKETS, "limits": {"min_side_px": 16, "default_steps": 3},
                                       "videos": {"folder": str(folder), "poll_s": 0.02, **videos}})


def _validator(config: ServeConfig) -> RequestValidator:
    return RequestValidator(config, SPEC, lambda text, negative=False: len(text.split()))


def _routes(folder, dit=None, **videos) -> VideoRoutes:
    config = _config(folder, **videos)
    validator = _validator(config)

    async def validate(request):
        return validator.validate(request)

    return VideoRoutes(config, validator, validate, dit or FakeVideoDiT(), "ingress-test")


def _json_request(body) -> object:
    return asgi_request("POST", "/v1/videos", json.dumps(body).encode(), JSON)


def _form_request(fields: dict, files: dict | None = None):
    """The body the openai client's ``videos.create`` sends: multipart, every field a part (a file for files)."""
    parts = [(k, (None, str(v))) for k, v in fields.items()] + list((files or {}).items())
    sent = httpx.Request("POST", "http://127.0.0.1/v1/videos", files=parts)
    return asgi_request("POST", "/v1/videos", sent.read(), list(sent.headers.items()))


def _answer(response) -> tuple[int, dict]:
    return response.status_code, json.loads(response.body)


def test_seconds_and_size_map_onto_the_video_tiers_at_the_model_frame_rate(tmp_path):
    options = VideoOptions.for_model(_validator(_config(tmp_path)), _config(tmp_path).videos)
    assert (options.seconds, options.frames, options.fps) == (("1", "2"), (17, 33), 16.0)  # Wan: 16 fps, 1 + 16 s
    # the model's default size and frames (832x480, 81) are no tier here: the first size, the fewest frames
    assert (options.default_size, options.default_frames) == ("48x32", 17)
    shape = options.shape("2", "32x48")
    assert (shape.width, shape.height, shape.num_frames, shape.seconds, shape.fps) == (32, 48, 33, "2", 16.0)
    assert options.shape(2).num_frames == options.shape("2.0").num_frames == 33  # a JSON number, a decimal text
    assert (options.shape().num_frames, options.shape().size) == (17, "48x32")
    slow = VideoOptions.for_model(_validator(_config(tmp_path)), _config(tmp_path, fps=4).videos)
    assert slow.seconds == ("4", "8") and slow.shape("8").num_frames == 33  # videos.fps sets the rate


@pytest.mark.parametrize("seconds,size,field,allowed", [
    ("4", "48x32", "seconds", "allowed: '1', '2' (1 + seconds x 16 fps frames: 17, 33; omitted: '1')"),
    ("1.5", None, "seconds", "'1', '2'"),
    (True, None, "seconds", "'1', '2'"),
    (None, "720x1280", "size", "allowed: '48x32', '32x48' (the video buckets' sizes; omitted: '48x32')"),
    (None, "48X32", "size", "'48x32', '32x48'"),
])
def test_an_unserved_seconds_or_size_is_refused_listing_the_allowed_values(tmp_path, seconds, size, field, allowed):
    options = VideoOptions.for_model(_validator(_config(tmp_path)), _config(tmp_path).videos)
    with pytest.raises(RequestError) as err:
        options.shape(seconds, size)
    assert err.value.field == field and allowed in err.value.message and err.value.status == 422


def test_create_as_json_and_as_the_openai_clients_form_queues_a_job_with_its_resolved_request(tmp_path):
    dit = FakeVideoDiT()
    routes = _routes(tmp_path, dit)

    async def run():
        a = _answer(await routes.create(_json_request({"prompt": "a red fox", "seconds": "2", "size": "32x48",
                                                       "seed": 7, "guidance_scale": 4.0})))
        b = _answer(await routes.create(_form_request({"prompt": "a boat", "seed": "9", "model": "tiny-wan"})))
        return a, b

    (sa, a), (sb, b) = asyncio.run(run())
    assert (sa, sb) == (200, 200) and a["object"] == b["object"] == "video" and a["status"] == b["status"] == "queued"
    assert (a["seconds"], a["size"], a["model"], a["progress"]) == ("2", "32x48", "tiny-wan", 0)
    assert (b["seconds"], b["size"]) == ("1", "48x32")  # the defaults
    kept = routes.store.get(a["id"]).params
    assert kept == {"num_frames": 33, "fps": 16.0, "seed": 7, "num_inference_steps": 3, "guidance_scale": 4.0,
                    "negative_prompt": None, "guidance_scale_2": None}  # the same video if it runs again
    assert routes.store.get(b["id"]).params["seed"] == 9 and dit.sent == []  # nothing generated until claimed


def test_a_two_expert_models_guidance_scale_2_is_kept_with_the_job_and_sent_again(tmp_path):
    """Wan 2.2 (``boundary_ratio``): ``guidance_scale_2`` from the form as the client sends it, kept with the job and
    in the request its generation sends; omitted, it is ``guidance_scale``'s (``WanPipeline``'s default)."""
    from dataclasses import replace

    from deployments.videos.generation import job_request

    config = _config(tmp_path)
    validator = RequestValidator(config, replace(SPEC, boundary_ratio=0.875), lambda text, negative=False: 1)

    async def validate(request):
        return validator.validate(request)

    routes = VideoRoutes(config, validator, validate, FakeVideoDiT(), "ingress-test")

    async def run():
        a = await routes.create(_form_request({"prompt": "a fox", "guidance_scale": "4", "guidance_scale_2": "2.5"}))
        b = await routes.create(_json_request({"prompt": "a boat", "guidance_scale": 3.0}))
        return _answer(a)[1]["id"], _answer(b)[1]["id"]

    a, b = asyncio.run(run())
    assert routes.store.get(a).params["guidance_scale_2"] == 2.5
    assert job_request(routes.store.get(a)).guidance_scale_2 == 2.5
    assert routes.store.get(b).params["guidance_scale_2"] == 3.0


@pytest.mark.parametrize("make,status,param,needle", [
    (lambda: _form_request({"prompt": "x"}, {"input_reference": ("cat.png", b"\x89PNG\r\n", "image/png")}), 422,
     "input_reference", "image to video is not served yet; tiny-wan (WanPipeline) generates video from text only"),
    (lambda: _form_request({"prompt": "x", "input_reference[image_url]": "https://example.com/a.png"}), 422,
     "input_reference", "image to video is not served yet"),
    (lambda: _json_request({"prompt": "x", "input_reference": {"file_id": "file_1"}}), 422, "input_reference",
     "got {'file_id': 'file_1'}"),
    (lambda: _json_request({"prompt": "x", "seconds": "3", "size": "48x32"}), 422, "seconds", "allowed: '1', '2'"),
    (lambda: _form_request({"prompt": "x", "size": "1280x720"}), 422, "size", "allowed: '48x32', '32x48'"),
    (lambda: _json_request({"prompt": "x", "model": "sora-2"}), 422, "model", "allowed: 'tiny-wan' (or omit it)"),
    (lambda: _json_request({"prompt": "x", "seed": "7"}), 422, "seed", "invalid 'seed' (got '7')"),  # strict JSON
    (lambda: _json_request({"prompt": "x", "fps": 24}), 422, "fps", "unknown field 'fps'; allowed fields: prompt"),
    (lambda: _json_request({"seconds": "1"}), 422, "prompt", "'prompt' is required"),
    (lambda: _json_request({"prompt": "x", "num_inference_steps": 0}), 422, "num_inference_steps", "from 1 to"),
    (lambda: _json_request({"prompt": "x", "guidance_scale": 4.0, "guidance_scale_2": 2.0}), 422, "guidance_scale_2",
     "has one transformer (no boundary_ratio); leave it unset; allowed: a number from 0 to"),
    (lambda: _form_request({"prompt": "x", "guidance_scale_2": "high"}), 422, "guidance_scale_2",
     "invalid 'guidance_scale_2' (got 'high')"),
    (lambda: asgi_request("POST", "/v1/videos", b"{nope", JSON), 400, "request", "not valid JSON"),
    (lambda: asgi_request("POST", "/v1/videos", b"prompt=x", [("content-type", "application/x-www-form-urlencoded")]),
     415, "request", "takes a JSON or multipart/form-data body"),
    (lambda: asgi_request("POST", "/v1/videos", b"x", [("content-type", "text/plain")]), 415, "request", "text/plain"),
    (lambda: _form_request({"prompt": "x"}, {"seed": ("seed.txt", b"7", "text/plain")}), 422, "seed",
     "the one file part is 'input_reference'"),
])
def test_create_refuses_bad_bodies_in_openais_error_shape(tmp_path, make, status, param, needle):
    routes = _routes(tmp_path)
    got, body = _answer(asyncio.run(routes.create(make())))
    assert (got, body["error"]["param"], body["error"]["type"]) == (status, param, "invalid_request_error"), body
    assert needle in body["error"]["message"], body
    assert routes.store.counts()["queued"] == 0


def test_retrieve_list_delete_cancel_and_content_answer_as_openai_does(tmp_path):
    routes = _routes(tmp_path)  # its worker is not started: the jobs stay queued

    async def run():
        ids = [json.loads((await routes.create(_json_request({"prompt": f"clip {i}"}))).body)["id"] for i in range(3)]
        get = lambda q: routes.list(asgi_request("GET", "/v1/videos", query=q))  # noqa: E731
        first = _answer(await get("limit=2&order=asc"))[1]
        second = _answer(await get(f"limit=2&order=asc&after={first['last_id']}"))[1]
        newest = _answer(await get(""))[1]
        refusals = [_answer(await get(q)) for q in ("after=video_" + "0" * 32, "limit=0", "limit=101", "order=new")]
        queued = await routes.retrieve(ids[0])
        missing = _answer(await routes.retrieve("video_" + "f" * 32))
        malformed = _answer(await routes.retrieve("../jobs.sqlite3"))
        early = _answer(await routes.content(ids[0], asgi_request("GET", "/c")))
        gif = _answer(await routes.content(ids[0], asgi_request("GET", "/c", query="variant=gif")))
        cancelled = _answer(await routes.cancel(ids[1]))
        again = _answer(await routes.cancel(ids[1]))
        deleted = _answer(await routes.delete(ids[2]))
        gone = _answer(await routes.retrieve(ids[2]))
        return ids, first, second, newest, refusals, queued, missing, malformed, early, gif, cancelled, again, \
            deleted, gone

    ids, first, second, newest, refusals, queued, missing, malformed, early, gif, cancelled, again, deleted, gone = \
        asyncio.run(run())
    assert [v["id"] for v in first["data"]] == ids[:2] and first["has_more"] and first["first_id"] == ids[0]
    assert [v["id"] for v in second["data"]] == ids[2:] and not second["has_more"]
    assert [v["id"] for v in newest["data"]] == ids[::-1] and newest["object"] == "list"  # desc by default
    assert [(s, b["error"]["param"]) for s, b in refusals] == [(400, "after"), (400, "limit"), (400, "limit"),
                                                              (400, "order")]
    assert "an integer from 1 to 100" in refusals[1][1]["error"]["message"]
    assert "'asc', 'desc'" in refusals[3][1]["error"]["message"]
    assert queued.status_code == 200 and queued.headers["openai-poll-after-ms"] == "1000"
    assert missing[0] == 404 and missing[1]["error"]["code"] == "video_not_found"
    assert malformed[0] == 404 and "an id is 'video_' and 32 hex digits" in malformed[1]["error"]["message"]
    assert early[0] == 404 and "ready once it is completed" in early[1]["error"]["message"]
    assert gif[0] == 400 and "'video', 'thumbnail', 'spritesheet'" in gif[1]["error"]["message"]
    assert cancelled[0] == 200 and cancelled[1]["status"] == "failed"
    assert cancelled[1]["error"] == {"code": "cancelled", "message": "cancelled by request"}
    assert again[0] == 409 and "already failed" in again[1]["error"]["message"]
    assert deleted == (200, {"id": ids[2], "object": "video.deleted", "deleted": True}) and gone[0] == 404


def test_a_job_runs_on_the_worker_to_an_mp4_with_progress_and_its_three_files(tmp_path, monkeypatch):
    import av

    monkeypatch.setattr(worker_module, "PROGRESS_EVERY_S", 0.0)
    hold = asyncio.Event()
    dit = FakeVideoDiT(hold)
    routes = _routes(tmp_path, dit)

    async def run():
        routes.worker.start()
        made = json.loads((await routes.create(_json_request({"prompt": "a kite", "seconds": "2", "seed": 200}))).body)
        seen = []
        for _ in range(200):  # bounded: 200 x 20 ms
            job = json.loads((await routes.retrieve(made["id"])).body)
            seen.append(job["progress"])
            if job["progress"] == 33:  # its first of 3 steps written; the fake DiT holds it there
                hold.set()
            if job["status"] in ("completed", "failed"):
                break
            await asyncio.sleep(0.02)
        files = {v: await routes.content(made["id"], asgi_request("GET", "/c", query=f"variant={v}"))
                 for v in ("video", "thumbnail", "spritesheet")}
        released = await routes.worker.stop()
        return job, seen, files, released

    job, seen, files, released = asyncio.run(run())
    assert job["status"] == "completed" and job["progress"] == 100 and 33 in seen, (job, seen)
    assert job["completed_at"] is not None and job["expires_at"] == job["completed_at"] + 7 * 86400
    assert [f.media_type for f in files.values()] == ["video/mp4", "image/webp", "image/jpeg"]
    (shape, validated), = dit.sent
    assert shape == "i54_t512_g9x2x3" and validated.request.seed == 200  # routed by its bucket shape (9 latent frames)
    with av.open(io.BytesIO(files["video"].path.read_bytes())) as mp4:
        frames = [f.to_ndarray(format="rgb24") for f in mp4.decode(video=0)]
        rate = mp4.streams.video[0].average_rate
    assert (len(frames), frames[0].shape, rate) == (33, (32, 48, 3), 16)  # 2 s at 16 fps; 48x32
    assert abs(int(frames[16].mean()) - 200) <= 2  # the fake's pixels, through H.264
    assert released == 0 and routes.worker.completed == 1


def test_cancelling_a_running_job_stops_its_generation_at_the_dit(tmp_path):
    hold = asyncio.Event()
    dit = FakeVideoDiT(hold)
    routes = _routes(tmp_path, dit)

    async def run():
        routes.worker.start()
        made = json.loads((await routes.create(_json_request({"prompt": "a train"}))).body)
        for _ in range(200):  # bounded: until the fake DiT holds it after its first step
            if dit.streams and routes.worker.running:
                break
            await asyncio.sleep(0.01)
        cancelled = _answer(await routes.cancel(made["id"]))
        for _ in range(100):
            if not routes.worker.running:
                break
            await asyncio.sleep(0.01)
        left = routes.worker.running
        await routes.worker.stop()
        return made, cancelled, left

    made, cancelled, left = asyncio.run(run())
    assert cancelled[0] == 200 and cancelled[1]["error"]["code"] == "cancelled" and left == []
    assert dit.streams[0].cancelled  # the DiT call was cancelled: the request leaves at its next step
    assert routes.worker.dropped == 1 and routes.worker.completed == 0
    assert not (routes.store.files.folder(made["id"]) / "video.mp4").exists()
    assert routes.store.get(made["id"]).status.value == "failed"


def test_an_image_model_answers_the_video_routes_404_naming_what_it_makes():
    image = ModelSpec("bcg-tiny-flux", "tiny", "FluxPipeline", ShapeRules(16, False, None))
    status, body = _answer(videos_unsupported(image, "POST /v1/videos"))
    assert (status, body["error"]["code"]) == (404, "unsupported_endpoint")
    assert "POST /v1/videos: model 'bcg-tiny-flux' (FluxPipeline) generates images, not videos" in \
        body["error"]["message"]
