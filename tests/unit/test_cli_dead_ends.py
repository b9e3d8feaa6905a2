"""No dead ends in the ``bcg`` command line (issue 23, point 3): ``bcg verify`` shows progress, an estimate and
the ``--bucket`` quick check; ``bcg demo --url`` sends an API key; ``bcg plan`` prints whole request counts and
says (and does not write without ``--force``) when the current table is already better.

Fast and without Ray: verify runs the tiny model on a 6-bucket table (the pipeline built once per module), the
demo talks to a fake server on 127.0.0.1, the plan uses the token-count cost model on the packaged krea sample.
"""

from __future__ import annotations

import re

import pytest

from deployments.cli import commands
from deployments.cli.main import main

# -- bcg verify ----------------------------------------------------------------------------------------------

SMALL_TABLE = 'buckets:\n  batch_sizes: [1, 2]\n  resolutions: ["256x256", "320x256"]\n'
SMALL_KEYS = ("b1_i256_t256", "b1_i320_t256", "b1_i320_m_t256", "b2_i256_t256", "b2_i320_t256", "b2_i320_m_t256")


@pytest.fixture(scope="module")
def _small_pipeline(tmp_path_factory):
    from deployments.settings import load_config

    path = tmp_path_factory.mktemp("verify") / "small.yaml"
    path.write_text(SMALL_TABLE)
    return str(path), commands._pipeline(load_config(config_path=str(path)))


@pytest.fixture()
def small_config(_small_pipeline, monkeypatch):
    """The small table's config file; ``bcg verify`` gets the pipeline built once (the model loads in seconds)."""
    path, pipe = _small_pipeline
    monkeypatch.setattr(commands, "_pipeline", lambda config, prepare=True: pipe)
    return path


def test_verify_of_the_whole_table_shows_the_bucket_hint_progress_per_bucket_and_an_estimate(small_config, capsys):
    assert main(["verify", "--config", small_config]) == 0
    captured = capsys.readouterr()
    err = captured.err.replace("\r", "\n")
    assert "checking all 6 buckets (8 cases); for a quick check give one or more: bcg verify --bucket b1_i256_t256" \
        in err
    for i, key in enumerate(SMALL_KEYS, start=1):
        assert f"bucket {i}/6: {key}" in err  # the bar names each bucket as it runs
    assert "6 buckets checked" in err and "checked 6 buckets (8 cases) in " in err
    estimate = [line for line in err.splitlines() if line.startswith("estimate: ~")]
    assert len(estimate) == 1 and "for 8 cases (measured before starting: the smallest case" in estimate[0]
    # the estimate comes before the first bucket runs
    assert err.index("estimate: ~") < err.index("bucket 1/6: b1_i256_t256")
    assert "6 of 6 buckets passed" in captured.out  # the table stays on stdout


def test_verify_of_chosen_buckets_has_no_hint_and_keeps_the_exit_status(small_config, capsys):
    assert main(["verify", "--config", small_config, "--bucket", "b1_i320_m_t256", "--bucket", "b2_i256_t256"]) == 0
    err = capsys.readouterr().err.replace("\r", "\n")
    assert "for a quick check" not in err
    assert "bucket 1/2: b1_i320_m_t256" in err and "bucket 2/2: b2_i256_t256" in err
    # a tolerance no masked bucket meets still fails with exit status 1
    assert main(["verify", "--config", small_config, "--rtol", "1e-30", "--bucket", "b2_i320_m_t256"]) == 1
    assert "FAIL" in capsys.readouterr().out
    assert main(["verify", "--config", small_config, "--bucket", "b9_i1_t1"]) == 2
    err = capsys.readouterr().err
    assert "is not in the table" in err and "buckets: b1_i256_t256" in err and "loading the model" not in err
    assert main(["verify", "--config", small_config, "--bucket", "b2_i256_t265"]) == 2  # a typo: the closest named
    assert "is not in the table (closest: b2_i256_t256" in capsys.readouterr().err


def test_verify_estimate_prices_each_case_on_the_line_through_the_smallest_and_the_largest():
    tokens = [100, 1000, 1000, 2000, 4000, 12100]
    # 0.2 s at 100 tokens, 1.4 s at 12,100: 0.1 ms per token plus 0.19 s per case
    seconds, text = commands.verify_estimate((100, 0.2), (12100, 1.4), tokens)
    assert seconds == pytest.approx(6 * 0.19 + 1e-4 * sum(tokens))
    assert text.startswith("estimate: ~3 s for 6 cases (measured before starting: the smallest case 0.20 s for 100 "
                           "tokens, the largest 1.40 s for 12,100")
    # a negative intercept (the small case fast for its size) is clipped to 0 s per case; one size: s per token
    assert commands.verify_estimate((100, 0.0), (1000, 9.0), [100, 1000])[0] == pytest.approx(1.0 + 10.0)
    assert commands.verify_estimate((500, 1.0), (500, 1.0), [500] * 4)[0] == pytest.approx(4.0)
    assert "~1.5 h for 3 cases" in commands.verify_estimate((10, 20.0), (10, 20.0), [10, 10, 2680])[1]


# -- bcg demo --url with an API key ----------------------------------------------------------------------------

DEMO_KEY = "sk-demo-5c1e9a7f3b"
_PNG = (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\x00\x00\x00\x01\x00\x00\x00\x01\x08\x06\x00\x00\x00\x1f\x15\xc4\x89"
        b"\x00\x00\x00\rIDATx\x9cc\xf8\x0f\x00\x00\x01\x01\x00\x05\x18\xd8N\x00\x00\x00\x00IEND\xaeB`\x82")


@pytest.fixture()
def keyed_server():
    """A fake bcg-serve on 127.0.0.1 whose /v1/ routes ask for ``Bearer DEMO_KEY`` (401 in OpenAI's shape
    otherwise) and whose /healthz asks for nothing; yields its URL and the Authorization headers it saw."""
    import base64
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    seen: list[tuple[str, str | None]] = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _answer(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _keyed(self) -> bool:
            seen.append((self.path, self.headers.get("Authorization")))
            if self.headers.get("Authorization") == f"Bearer {DEMO_KEY}":
                return True
            self._answer(401, {"error": {"message": "Incorrect API key provided.", "type": "invalid_request_error",
                                         "param": None, "code": "invalid_api_key"}})
            return False

        def do_GET(self):
            if self.path == "/healthz":
                self._answer(200, {"status": "ok"})
            elif self._keyed():
                self._answer(200, {"object": "list", "data": []} if self.path == "/v1/models" else
                             {"model": {"name": "fake"}, "table": {"miss_policy": "eager"},
                              "buckets": [{"key": "b1_i256_t256", "requests": 1, "hits": 1, "mode": "graph"}],
                              "misses": {"requests": 0, "by_dim": {}}})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if self._keyed():
                self._answer(200, {"data": [{"b64_json": base64.b64encode(_PNG).decode()}] * body["n"],
                                   "bcg": {"bucket": "b1_i256_t256", "hit": True}})

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", seen
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def _demo(url: str, tmp_path, *extra: str) -> int:
    return main(["demo", "--url", url, "--requests", "1", "--out", str(tmp_path / "out"), *extra])


def test_demo_sends_the_first_key_of_the_key_file_on_every_keyed_request(keyed_server, tmp_path, capsys,
                                                                        monkeypatch):
    url, seen = keyed_server
    monkeypatch.setenv("OPENAI_API_KEY", "sk-wrong-from-env")  # the flag wins over the variable
    keys = tmp_path / "keys.txt"
    keys.write_text(f"# demo keys\n\n  {DEMO_KEY}  \nsk-second-one\n")
    assert _demo(url, tmp_path, "--api-key-file", str(keys)) == 0
    captured = capsys.readouterr()
    assert {path for path, _ in seen} == {"/v1/models", "/v1/images/generations", "/v1/buckets"}
    assert all(auth == f"Bearer {DEMO_KEY}" for _, auth in seen)
    assert len(list((tmp_path / "out").glob("req001_img*.png"))) == 9  # the first data row asks for 9 images
    assert DEMO_KEY not in captured.out + captured.err


def test_demo_reads_openai_api_key_from_the_environment(keyed_server, tmp_path, capsys, monkeypatch):
    url, seen = keyed_server
    monkeypatch.setenv("OPENAI_API_KEY", f" {DEMO_KEY}\n")
    assert _demo(url, tmp_path) == 0
    assert seen and all(auth == f"Bearer {DEMO_KEY}" for _, auth in seen)
    captured = capsys.readouterr()
    assert DEMO_KEY not in captured.out + captured.err


def _own(err: str) -> str:
    """Our lines of stderr, without the log lines a Ray session of other tests in this process may print there
    (``(ServeReplica...)``, ``(raylet)``, ANSI-coloured)."""
    return "\n".join(line for line in err.strip().splitlines() if not re.match(r"(\x1b\[[0-9;]*m)?\(", line))


def test_demo_without_a_key_or_with_a_wrong_one_stops_with_one_line_naming_both_ways(keyed_server, tmp_path, capsys,
                                                                                    monkeypatch):
    url, seen = keyed_server
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    assert _demo(url, tmp_path) == 2
    err = _own(capsys.readouterr().err)
    assert err == (f"bcg demo: error: the server at {url} asks for an API key (HTTP 401): give one with "
                   f"--api-key-file PATH (its first key) or the OPENAI_API_KEY environment variable")
    assert [path for path, _ in seen] == ["/v1/models"]  # stopped before sending any request
    assert not (tmp_path / "out").exists()

    monkeypatch.setenv("OPENAI_API_KEY", "sk-not-the-servers-key")
    assert _demo(url, tmp_path) == 2
    err = _own(capsys.readouterr().err)
    assert len(err.splitlines()) == 1 and "sk-not-the-servers-key" not in err
    assert err.startswith(f"bcg demo: error: the server at {url} refused the API key from the OPENAI_API_KEY "
                          f"environment variable (HTTP 401)")
    assert "--api-key-file PATH" in err and "OPENAI_API_KEY environment variable" in err


def test_demo_refuses_a_key_file_without_a_key_or_a_key_no_header_can_carry_before_sending(tmp_path, capsys,
                                                                                          monkeypatch):
    from deployments.cli.demo import demo_api_key

    empty = tmp_path / "empty.txt"
    empty.write_text("# nothing here\n")
    assert main(["demo", "--url", "http://127.0.0.1:9", "--api-key-file", str(empty)]) == 2
    assert "holds no key" in capsys.readouterr().err
    assert main(["demo", "--url", "http://127.0.0.1:9", "--api-key-file", str(tmp_path / "missing.txt")]) == 2
    assert "cannot be read" in capsys.readouterr().err
    with pytest.raises(ValueError, match="the OPENAI_API_KEY environment variable holds white space") as info:
        demo_api_key(None, {"OPENAI_API_KEY": "sk-bad key"})
    assert "sk-bad" not in str(info.value)
    assert demo_api_key(None, {"OPENAI_API_KEY": "  "}) == (None, None)
    assert demo_api_key(None, {}) == (None, None)


# -- bcg plan: whole counts, and a current table that is already better -----------------------------------------

def _flat(text: str) -> str:
    return " ".join(text.split())  # rich wraps long lines at the console's width


def test_plan_says_the_current_table_is_better_and_writes_the_planned_one_only_with_force(tmp_path, capsys):
    import json
    import re

    out, report = tmp_path / "planned.yaml", tmp_path / "plan.json"
    # the packaged krea sample on the default table: the 12-graph plan is expected to cost more per image
    assert main(["plan", "--write", str(out), "--json", str(report)]) == 1
    captured = capsys.readouterr()
    text = _flat(captured.out)
    assert "bcg plan: krea traffic, 183 requests, costs: token-count (compiled hits)" in text  # 182.9 requests, rounded
    assert not re.search(r"\d\.\d+ requests", text)
    assert "refused by the limits (requests): num_inference_steps 26" in text  # 25.76, rounded
    assert ("the current table is already better: 161.89 ms per image expected against 167.67 for the planned one; "
            "the planned table has fewer graphs (12 against 63). Keep it; --write writes the planned table only "
            "with --force") in text
    assert not out.exists()
    # one line on stderr (in the full suite a Ray session of other tests may log there too)
    assert (f"bcg plan: not writing {out}: the current table is expected to cost 161.89 ms per image, the planned one "
            f"167.67; add --force to write the planned table anyway") in captured.err.splitlines()
    current = json.loads(report.read_text())["current"]  # the reports are still written
    assert current["at_least_as_good"] is True and current["graphs"] == 63

    assert "(planned for a GPU: model.device auto; model.device: cpu plans for a CPU)" in text
    assert main(["plan", "--write", str(tmp_path / "no" / "such" / "p.yaml")]) == 2  # refused before the search
    assert f"--write {tmp_path / 'no' / 'such' / 'p.yaml'}: its folder" in capsys.readouterr().err
    assert main(["plan", "--plot", str(tmp_path / "plan.txt")]) == 2  # a format matplotlib cannot write: before too
    assert ".txt is not an image format matplotlib writes; allowed: " in capsys.readouterr().err
    huge = tmp_path / "huge.csv"  # every request refused: a whole count
    huge.write_text("prompt,width,height,num_generations,num_step\n" + "a cat,8192,8192,1,20\n" * 3)
    assert main(["plan", "--krea", str(huge)]) == 2
    assert "has no request the limits allow" in (err := capsys.readouterr().err) and ": 3 requests)" in err, err
    assert main(["plan", "--write", str(out), "--force"]) == 0
    assert "(--force: the current table is expected to be as good or better)" in capsys.readouterr().out
    from deployments.settings import load_config

    assert load_config(config_path=str(out)).buckets.batch_sizes != [1, 2, 4, 8, 16, 18, 20]


def test_plan_writes_a_better_table_without_force_and_force_needs_write(tmp_path, capsys):
    import json

    poor = tmp_path / "poor.yaml"
    poor.write_text('buckets:\n  batch_sizes: [1]\n  resolutions: ["256x256"]\n')
    out, report = tmp_path / "planned.yaml", tmp_path / "plan.json"
    assert main(["plan", "--config", str(poor), "--write", str(out), "--json", str(report)]) == 0
    text = _flat(capsys.readouterr().out)
    assert "the planned table is expected" in text and "faster than the current one" in text
    assert "already" not in text and f"wrote {out}" in text and "--force" not in text
    assert out.exists() and json.loads(report.read_text())["current"]["at_least_as_good"] is False

    assert main(["plan", "--force"]) == 2
    assert _own(capsys.readouterr().err).startswith("bcg plan: error: --force goes with --write")


def test_whole_count_rounds_half_up_and_shows_a_sliver_as_under_one():
    from deployments.cli.plan_command import whole_count

    assert [whole_count(v) for v in (0, 0.2, 0.5, 2.5, 182.9, 25.7635, 7)] == ["0", "<1", "1", "3", "183", "26", "7"]
    for bad in (-1.0, float("nan")):
        with pytest.raises(ValueError, match="a request count must be a number >= 0"):
            whole_count(bad)


def test_lora_targets_that_match_no_layer_are_refused_before_ray_starts(tmp_path, capsys):
    """``lora.targets`` are checked against the transformer built on the meta device (no weights), so ``bcg serve``
    refuses them at once instead of after Ray and a replica have started."""
    (tmp_path / "loras").mkdir()
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"lora: {{dir: '{tmp_path / 'loras'}', targets: ['nomatch.*']}}\n")
    assert main(["serve", "--config", str(cfg)]) == 2
    assert "lora.targets ['nomatch.*'] match no linear layer of FluxTransformer2DModel" in capsys.readouterr().err


def test_bcg_warm_cache_dir_is_taken_with_home_expanded_and_absolute(tmp_path, monkeypatch):
    """``--cache-dir '~/c'`` (quoted: no shell expanded it) is the folder in the home folder, not a folder named
    ``~`` in the working one; a relative path is made absolute from the working folder."""
    import os

    monkeypatch.chdir(tmp_path)
    assert commands.cache_dir_arg("~/bcg-cache") == os.path.join(os.path.expanduser("~"), "bcg-cache")
    assert commands.cache_dir_arg("cache") == str(tmp_path / "cache")


def test_plan_from_a_url_sends_openai_api_key_as_demo_does_and_a_file_wins(tmp_path, monkeypatch, capsys):
    """``bcg plan --from URL`` takes its key as ``bcg demo`` does: ``--api-key-file``'s first key, else
    ``OPENAI_API_KEY``; a sample that is not a URL sends none."""
    from deployments.cli import plan_command

    sent = []

    def fake_run_plan(config, source, *args, api_key=None, **kwargs):
        sent.append((source, api_key))
        raise ValueError("stop here")

    monkeypatch.setattr(plan_command, "run_plan", fake_run_plan)
    monkeypatch.setenv("OPENAI_API_KEY", "sk-from-env")
    keys = tmp_path / "keys.txt"
    keys.write_text("# a comment\nsk-from-file\n")
    assert main(["plan", "--from", "http://127.0.0.1:9/"]) == 2
    assert main(["plan", "--from", "http://127.0.0.1:9/", "--api-key-file", str(keys)]) == 2
    assert main(["plan"]) == 2
    assert sent == [("http://127.0.0.1:9/", "sk-from-env"), ("http://127.0.0.1:9/", "sk-from-file"), ("krea", None)]
    assert "stop here" in capsys.readouterr().err
    assert main(["plan", "--api-key-file", str(keys)]) == 2  # a sample is not a server: refused, not ignored
    assert "--api-key-file is sent to a server: give it with --from URL" in capsys.readouterr().err
    assert len(sent) == 3


def test_bcg_serve_shows_what_adapter_rows_cost_when_lora_is_on():
    """The start-up warning about oversized LoRA settings is logged on the replica; ``bcg serve`` (whose Ray logs
    are quiet) prints the same note from the replica's ``/v1/buckets`` ``lora`` section."""
    from deployments.cli.console import ready_text

    plain = ready_text("http://127.0.0.1:8000", "m", None, False)
    assert "lora" not in plain
    lora = {"slots": 8, "layers": 24, "delta_share": 5.5484, "max_per_request": 4, "max_rank": 64}
    text = ready_text("http://127.0.0.1:8000", "m", None, False, lora)
    assert max(map(len, text.splitlines())) <= 118 and "\n  lora       8 slots; 24 layers wrapped;" in text
    words = " ".join(text.split())  # wrapped to the terminal's 120 columns
    assert ("lora 8 slots; 24 layers wrapped; a forward with adapter rows adds 554.8% to their matmul work" in words
            and "lower lora.max_rank and lora.max_per_request" in words)
    small = ready_text("http://127.0.0.1:8000", "m", None, False, {**lora, "delta_share": 0.02})
    assert "adds 2.0%" in small and "lower lora.max_rank" not in small


def test_bcg_plan_names_the_krea_file_and_refuses_it_beside_from(tmp_path, capsys):
    from deployments.cli.main import main

    assert main(["plan", "--from", "traffic.json", "--krea", "x.csv"]) == 2
    assert "--from replaces --traffic/--trace/--krea: give one traffic source" in capsys.readouterr().err
    assert main(["plan", "--krea", str(tmp_path / "none.csv")]) == 2
    assert f"{tmp_path / 'none.csv'}: no such file (a krea-format CSV)" in capsys.readouterr().err
    binary = tmp_path / "bin.csv"
    binary.write_bytes(b"\xfe\xff\x00\x81" * 64)
    assert main(["plan", "--krea", str(binary)]) == 2
    assert f"{binary} is not a krea-format CSV: not UTF-8 text" in capsys.readouterr().err


def test_missing_files_odd_urls_and_steps_outside_the_limits_are_named(capsys):
    from deployments.cli.main import main

    assert main(["config", "--check", "/no/such/config.yaml"]) == 2
    assert "bcg config: error: /no/such/config.yaml: no such file" in capsys.readouterr().err
    assert main(["plan", "--from", "ftp://127.0.0.1:8001"]) == 2
    assert "--from ftp://127.0.0.1:8001: an http:// or https:// URL of a server, or a JSON file" in \
        capsys.readouterr().err
    assert main(["plan", "--steps", "1000"]) == 2
    assert "--steps 1000 is outside the config's limits (limits.max_steps 50); use --steps 1 to 50" in \
        capsys.readouterr().err


def test_a_plan_report_given_as_traffic_or_config_says_what_it_is(tmp_path, capsys):
    import json

    from deployments.cli.main import main

    report = tmp_path / "plan.json"  # what bcg plan --json writes (its keys; the values do not matter here)
    report.write_text(json.dumps({"buckets": {}, "chosen": [], "shapes": [], "curve": [], "traffic": {"source": "krea"},
                                  "costs": {}, "budget_mib": None, "max_graphs": 12, "current": {}}))
    assert main(["plan", "--from", str(report)]) == 2
    assert "is a `bcg plan --json` report (the plan of some traffic), not recorded traffic" in capsys.readouterr().err
    assert main(["config", "--check", str(report)]) == 2
    err = capsys.readouterr().err
    assert "chosen, shapes, curve, costs, budget_mib, max_graphs, current: unknown fields; the config takes" in err
    assert err.count("the config takes") == 1  # one list of the fields per section, not one per unknown key
