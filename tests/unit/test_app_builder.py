"""The application builder's arguments (no Ray cluster needed: building only binds deployments)."""

from __future__ import annotations

import json

import pytest
from ray.serve import Application

from bcg_core.config import MissPolicy
from deployments import build_app, load_config


def test_config_path_yaml_and_json_give_the_same_config(tmp_path):
    yaml_file = tmp_path / "serve.yaml"
    yaml_file.write_text("buckets:\n  batch_sizes: [1, 2]\n  resolutions: ['256x256']\n  miss_policy: reject\n")
    json_file = tmp_path / "serve.json"
    json_file.write_text(json.dumps({"buckets": {"batch_sizes": [1, 2], "resolutions": ["256x256"],
                                                 "miss_policy": "reject"}}))
    a, b = load_config(config_path=yaml_file), load_config(config_path=json_file)
    assert a == b
    assert a.buckets.batch_sizes == [1, 2] and a.buckets.miss_policy is MissPolicy.REJECT


def test_no_arguments_serve_the_embedded_default():
    assert load_config() == load_config(config={})
    assert isinstance(build_app({}), Application)
    cfg = {"limits": {"max_images": 4}, "buckets": {"batch_sizes": [1, 2, 4, 8]}}
    assert isinstance(build_app({"config": cfg, "dit_num_gpus": 0}), Application)


def test_bad_arguments_are_rejected_at_build_time(tmp_path):
    # what `serve status` shows of a failed deploy: one line naming the field and what it takes, as bcg serve says it
    with pytest.raises(ValueError, match=r"^invalid application arguments: config_pth: unknown field \(did you mean "
                                         r"'config_path'\?\); the application takes config, config_path, "):
        build_app({"config_pth": "serve.yaml"})
    with pytest.raises(ValueError, match=r"^invalid configuration: limits.max_imags: unknown field \(did you mean "
                                         r"'max_images'\?\); limits takes max_images, "):
        build_app({"config": {"limits": {"max_imags": 4}}})
    with pytest.raises(ValueError, match="either config or config_path"):
        build_app({"config": {}, "config_path": str(tmp_path / "x.yaml")})
    with pytest.raises(ValueError, match="^invalid configuration: buckets.batch_sizes"):
        build_app({"config": {"buckets": {"batch_sizes": [4, 2]}}})
    listing = tmp_path / "list.yaml"
    listing.write_text("- 1\n- 2\n")
    with pytest.raises(ValueError, match="holds a list, not a mapping of sections"):
        build_app({"config_path": str(listing)})
    (tmp_path / "empty.yaml").write_text("")
    with pytest.raises(ValueError, match="is empty: write the sections to change .* or leave out the file"):
        build_app({"config_path": str(tmp_path / "empty.yaml")})


def test_bcg_config_check_reads_a_serve_file_as_the_controller_builds_it_and_a_config_as_bcg_serve(tmp_path, capsys):
    """``bcg config --check``: the packaged Serve files pass; a mistake in a Serve file's args or embedded config
    is exit 2 naming the application and the field; a ServeConfig file is checked as ``bcg serve`` checks it."""
    from pathlib import Path

    from deployments.cli.main import main

    root = Path(__file__).resolve().parents[2]
    assert main(["config", "--check", str(root / "deploy" / "serve_config_cpu.yaml")]) == 0
    assert "application bcg: ok" in capsys.readouterr().out
    serve_file = (root / "deploy" / "serve_config_cpu.yaml").read_text()
    bad = tmp_path / "serve.yaml"
    bad.write_text(serve_file.replace("dit_num_cpus", "dit_num_cpu"))
    assert main(["config", "--check", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "application bcg: invalid application arguments: dit_num_cpu: unknown field (did you mean " \
           "'dit_num_cpus'?)" in err, err
    config = tmp_path / "my.yaml"
    config.write_text("limits:\n  max_images: 3\n")
    assert main(["config", "--check", str(config)]) == 2
    assert "buckets.batch_sizes: 20 exceeds the most transformer rows a request can need, 6" in capsys.readouterr().err
    config.write_text("limits:\n  max_images: 3\nbuckets:\n  batch_sizes: [1, 2, 4]\n")
    assert main(["config", "--check", str(config)]) == 0
    assert capsys.readouterr().out.startswith(f"{config}: ok (model the tiny default")
    # KubeRay's manifest: the Serve file it embeds; a config_path only the nodes have: the args alone
    assert main(["config", "--check", str(root / "deploy" / "rayservice.yaml")]) == 0
    assert "application bcg: ok" in capsys.readouterr().out
    service = (root / "deploy" / "rayservice.yaml").read_text()
    twice = tmp_path / "rayservice.yaml"  # the embedded Serve file is read with the same duplicate-key rule
    twice.write_text(service.replace("dit_num_gpus: 1", "dit_num_gpus: 1\n        dit_num_gpus: 2", 1))
    assert main(["config", "--check", str(twice)]) == 2
    line = service.splitlines().index("        dit_num_gpus: 1") + 2  # the second one, as a line of the file
    assert (f"{twice}: spec.serveConfigV2: key 'dit_num_gpus' is given twice in one mapping (line {line})"
            in capsys.readouterr().err)
    other = tmp_path / "other.yaml"
    other.write_text("applications:\n- name: x\n  import_path: deployments.app:build_app\n"
                     "  args: {config_path: /on/the/nodes.yaml, dit_num_gpus: 1}\n- name: y\n  import_path: m:app\n")
    assert main(["config", "--check", str(other)]) == 0
    out = capsys.readouterr().out
    assert "application x: args ok; config_path '/on/the/nodes.yaml' is not here" in out, out
    assert "application y: not bcg-serve's (import_path), not checked" in out
    for body, why in (("applications: []\n", "applications must be a list of applications"),
                      ("applications:\n- 3\n", "applications[0] is a int, not a mapping"),
                      ("applications:\n- {name: z, import_path: 'deployments.app:build_app', args: [1]}\n",
                       "application z: args is a list, not a mapping of config, config_path")):
        other.write_text(body)
        assert main(["config", "--check", str(other)]) == 2
        assert why in capsys.readouterr().err, body


def test_bcg_config_check_notes_a_plan_block_the_server_would_not_use(tmp_path, capsys):
    """A hand-edited ``buckets.plan``: bad values are refused; a plan of other shapes, or one expecting misses
    under ``miss_policy: reject``, passes (a server starts with it) with a note saying what happens."""
    from deployments.cli.main import main

    config = tmp_path / "my.yaml"
    head = "buckets:\n  miss_policy: reject\n  plan:\n    source: krea\n    requests: 10\n    waste: 0.1\n" \
           "    ms_per_image: 5\n    costs: token-count\n    miss_share: 0.31\n"
    config.write_text(head + "    work: {i9999_t256: 0.5}\n")
    assert main(["config", "--check", str(config)]) == 0
    out = capsys.readouterr().out
    assert "note: buckets.plan does not describe this table" in out
    assert "note: buckets.miss_policy is reject, and the plan expected 31.0% of its requests" in out
    config.write_text(head + "    cost_lines: {graph_launch_ms: -0.5}\n")
    assert main(["config", "--check", str(config)]) == 2
    assert "cost_lines.graph_launch_ms is -0.5: a cost is a finite number, 0 or more" in capsys.readouterr().err
    config.write_text(head + "    work: {nonsense: 0.5}\n")
    assert main(["config", "--check", str(config)]) == 2
    assert "buckets.plan: 'nonsense' is not a bucket shape: expected i<image tokens>" in capsys.readouterr().err
