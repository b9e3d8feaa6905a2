"""The demo's pure parts: data rows -> requests, request bodies, file names, the ``bcg`` CLI's config output."""

from __future__ import annotations

import csv
import io
import json

import pytest
import yaml

from deployments.cli.demo import SEED_MODULUS, DemoRequest, load_requests, read_requests
from deployments.cli.main import config_text, main
from deployments.settings import ServeConfig

HEADER = "prompt,width,height,num_step,cfg_scale,seed,num_generations,is_grid,timestamp,sampler_flag,image_uri\n"


def _rows(text: str) -> list[dict[str, str]]:
    return list(csv.DictReader(io.StringIO(HEADER + text)))


def test_rows_become_requests_with_size_n_and_seed():
    rows = _rows('"a cat, oil",512,768,50.0,7.0,3884635196.0,9.0,0.0,1660218797.0,,x\n'
                 "a dog,768.0,512.0,50.0,7.0,12.0,1.0,0.0,1660218797.0,,x\n")
    first, second = read_requests(rows, limit=10)
    assert (first.prompt, first.width, first.height, first.size, first.n) == ("a cat, oil", 512, 768, "512x768", 9)
    assert first.seed == 3884635196 % SEED_MODULUS == 1737151548
    assert (second.width, second.height, second.n, second.seed) == (768, 512, 1, 12)
    assert [r.number for r in (first, second)] == [1, 2]


def test_empty_num_generations_means_one_image_and_empty_seed_means_none():
    (req,) = read_requests(_rows("a fox,512,512,,,,,,,,x\n"), limit=5)
    assert req.n == 1
    assert req.seed is None
    assert "seed" not in req.body(steps=3)


def test_rows_with_empty_or_blank_prompt_are_skipped_and_do_not_count():
    rows = _rows(",512,512,,,1.0,1.0,,,,x\n"
                 '"   ",512,512,,,1.0,1.0,,,,x\n'
                 "kept one,256,256,,,1.0,2.0,,,,x\n"
                 "kept two,256,256,,,1.0,2.0,,,,x\n"
                 "not reached,256,256,,,1.0,2.0,,,,x\n")
    reqs = read_requests(rows, limit=2)
    assert [r.prompt for r in reqs] == ["kept one", "kept two"]
    assert [r.row for r in reqs] == [2, 3]  # data rows, header excluded, skipped rows still counted
    assert [r.number for r in reqs] == [1, 2]


def test_body_matches_the_http_api():
    req = DemoRequest(number=3, row=7, prompt="p", width=512, height=768, n=2, seed=5)
    assert req.body(steps=4) == {"prompt": "p", "n": 2, "size": "512x768", "response_format": "b64_json",
                                 "num_inference_steps": 4, "seed": 5}
    assert req.image_name(1) == "req003_img1.png"


@pytest.mark.parametrize("cell, column", [("512.5", "width"), ("abc", "height"), ("", "width")])
def test_bad_size_cell_is_an_error_naming_the_row(cell, column):
    values = {"width": "512", "height": "512", column: cell}
    rows = _rows(f"x,{values['width']},{values['height']},,,,,,,,u\n")
    with pytest.raises(ValueError, match="data row 0"):
        read_requests(rows, limit=1)


def test_limit_must_be_positive():
    with pytest.raises(ValueError, match="limit 0"):
        read_requests([], limit=0)


def test_shipped_data_file_gives_the_first_requests():
    reqs = load_requests(8)
    assert len(reqs) == 8
    assert reqs[0].prompt.startswith("A portrait photo of a kangaroo")
    assert (reqs[0].size, reqs[0].n, reqs[0].seed) == ("512x512", 9, 556046175)
    assert reqs[3].size == "512x768"
    assert all(0 <= r.seed < SEED_MODULUS for r in reqs if r.seed is not None)


def test_shipped_data_file_skips_its_empty_prompts():
    reqs = load_requests(998)
    assert len(reqs) == 998 - 9  # the data README: 9 rows have an empty prompt
    assert all(r.prompt.strip() for r in reqs)
    assert 105 not in {r.row for r in reqs}


def test_config_yaml_and_json_round_trip_to_the_default():
    assert ServeConfig.model_validate(yaml.safe_load(config_text(fmt="yaml"))) == ServeConfig()
    assert ServeConfig.model_validate(json.loads(config_text(fmt="json"))) == ServeConfig()


def test_cli_rejects_out_of_range_concurrency(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--concurrency", "0"])
    assert exit_info.value.code == 2
    assert "out of range" in capsys.readouterr().err


def test_cli_demo_refuses_config_with_url(capsys):
    assert main(["demo", "--url", "http://127.0.0.1:9", "--config", "x.yaml"]) == 2
    assert "--config and --port" in capsys.readouterr().err


def test_demo_url_ending_in_v1_is_taken_as_the_server_above_it(tmp_path, monkeypatch, capsys):
    """``--url http://host:port/v1`` (the openai client's base_url) is the server at ``http://host:port``."""
    import deployments.cli.demo as demo

    asked = []

    def wait_healthy(url, timeout_s):
        asked.append(url)
        raise TimeoutError(f"{url}/healthz did not answer")

    monkeypatch.setattr(demo, "wait_healthy", wait_healthy)
    with pytest.raises(TimeoutError):
        demo.run_demo(url="http://127.0.0.1:9/v1/", out=tmp_path / "out")
    assert asked == ["http://127.0.0.1:9"] and "the server's base URL is http://127.0.0.1:9" in capsys.readouterr().out


def test_cli_serve_refuses_replicas_with_autoscaling(tmp_path, capsys):
    cfg = tmp_path / "autoscale.yaml"
    cfg.write_text("autoscaling: {enabled: true, max_replicas: 3}\n")
    assert main(["serve", "--config", str(cfg), "--replicas", "2"]) == 2  # before Ray starts
    err = capsys.readouterr().err
    assert "--replicas 2 conflicts with autoscaling.enabled" in err and "max_replicas" in err


def test_the_replay_is_fitted_to_the_servers_limits():
    """``bcg demo --url`` against a server with tighter limits: ``n`` is capped at its ``max_images``, sizes outside
    its sides are left out, each change is said; steps above its ``max_steps`` and no request left are errors."""
    from deployments.cli.demo import fit_to_limits

    todo = load_requests(8)
    assert fit_to_limits(todo, {}, 4) == (todo, [])  # a server that does not say its limits: sent as they are
    kept, notes = fit_to_limits(todo, {"max_images": 4, "min_side_px": 256, "max_side_px": 2048, "max_steps": 50}, 4)
    assert [r.n for r in kept] == [min(r.n, 4) for r in todo] and any(r.n > 4 for r in todo)
    assert [(r.prompt, r.size, r.seed) for r in kept] == [(r.prompt, r.size, r.seed) for r in todo]
    assert notes == [f"n capped at the server's limits.max_images, 4, for {sum(r.n > 4 for r in todo)} request(s)"]
    small = min(min(r.width, r.height) for r in todo)
    kept, notes = fit_to_limits(todo, {"min_side_px": small + 16}, 4)
    assert kept and all(min(r.width, r.height) > small for r in kept) and len(kept) < len(todo)
    assert notes[0].startswith(f"left out {len(todo) - len(kept)} request(s) whose size is outside")
    with pytest.raises(ValueError, match="--steps 60 is above the server's limits.max_steps 50"):
        fit_to_limits(todo, {"max_steps": 50}, 60)
    with pytest.raises(ValueError, match="none of the 8 requests has a size within the server's sides"):
        fit_to_limits(todo, {"max_side_px": 128}, 4)
