"""The application builder's arguments (no Ray cluster needed: building only binds deployments)."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError
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
    with pytest.raises(ValidationError, match="config_pth"):
        build_app({"config_pth": "serve.yaml"})
    with pytest.raises(ValueError, match="either config or config_path"):
        build_app({"config": {}, "config_path": str(tmp_path / "x.yaml")})
    with pytest.raises(ValidationError, match="batch_sizes"):
        build_app({"config": {"buckets": {"batch_sizes": [4, 2]}}})
    listing = tmp_path / "list.yaml"
    listing.write_text("- 1\n- 2\n")
    with pytest.raises(ValueError, match="holds a list, not a mapping of sections"):
        build_app({"config_path": str(listing)})
    (tmp_path / "empty.yaml").write_text("")
    with pytest.raises(ValueError, match="is empty: write the sections to change .* or leave out the file"):
        build_app({"config_path": str(tmp_path / "empty.yaml")})
