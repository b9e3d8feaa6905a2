"""Config checks that stop a server from starting with values no request could use or no device can run."""

import pytest
import torch
import yaml
from pydantic import ValidationError

from bcg_core import BucketConfig, ModelConfig, RunnerConfig
from bcg_core.devices import resolve_device
from bcg_core.pipeline import runner_mode
from deployments.settings import ServeConfig, load_config


@pytest.mark.parametrize("kw,needle", [
    (dict(limits=dict(default_guidance_scale=50.0)), "exceeds max_guidance_scale"),
    (dict(buckets=dict(resolutions=["512x512", "4096x4096"])), "outside the request limits"),
    (dict(buckets=dict(resolutions=["128x128"])), "outside the request limits"),
    (dict(buckets=dict(batch_sizes=[1, 100000])), "2 x limits.max_images"),
    (dict(metrics=dict(host="10.0.0.1")), "'127.0.0.1' or '0.0.0.0'"),
    (dict(metrics=dict(port=70000)), "less than or equal to 65535"),
])
def test_configs_with_unusable_values_are_refused(kw, needle):
    with pytest.raises(ValidationError) as e:
        ServeConfig.model_validate(kw)
    assert needle in str(e.value)


def test_every_unreachable_bucket_is_named_in_one_refusal():
    """An edited table with several mistakes is refused once with all of them, not one per attempt."""
    cfg = dict(limits=dict(max_images=3, max_side_px=512),
               buckets=dict(resolutions=["256x256", "768x768", "1024x1024"]))
    with pytest.raises(ValidationError) as e:
        ServeConfig.model_validate(cfg)
    text = str(e.value)
    assert "buckets.resolutions: 768x768, 1024x1024 are outside the request limits" in text
    assert "drop them (use ['256x256'])" in text
    assert "buckets.batch_sizes: 20 exceeds the most transformer rows a request can need, 6" in text


def test_default_steps_and_guidance_are_unset_meaning_the_familys_and_set_values_stay_valid():
    lim = ServeConfig().limits
    # the family's (RequestValidator fills them)
    assert lim.default_steps is None and lim.default_guidance_scale is None
    old = ServeConfig.model_validate({"limits": {"default_steps": 4, "default_guidance_scale": 3.5}}).limits
    assert (old.default_steps, old.default_guidance_scale) == (4, 3.5)
    with pytest.raises(ValidationError, match="exceeds max_steps"):
        ServeConfig.model_validate({"limits": {"default_steps": 60}})


def test_default_limits_reach_every_default_bucket_and_n10_with_guidance_is_a_hit():
    cfg = ServeConfig()
    assert cfg.buckets.batch_sizes[-1] == 2 * cfg.limits.max_images


def test_config_files_that_are_not_yaml_say_so(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [1\n")
    with pytest.raises(ValueError, match=rf"(?s)not valid YAML/JSON: .*in \"{bad}\", line 1"):  # names the file
        load_config(config_path=bad)
    twice = tmp_path / "twice.yaml"  # an edited config whose second limits: would silently replace the first
    twice.write_text("limits:\n  max_images: 4\nbuckets:\n  batch_sizes: [1, 2]\nlimits:\n  max_steps: 8\n")
    with pytest.raises(ValueError, match=r"key 'limits' is given twice in one mapping \(line 5\); keep one"):
        load_config(config_path=twice)
    twice.write_text("limits:\n  max_images: 4\n  max_images: 2\n")
    with pytest.raises(ValueError, match=r"key 'max_images' is given twice in one mapping \(line 3\)"):
        load_config(config_path=twice)
    twice.write_text("limits: {<<: {max_images: 4, max_images: 2}}\n")  # also inside a merge key's value
    with pytest.raises(ValueError, match=r"key 'max_images' is given twice in one mapping \(line 1\)"):
        load_config(config_path=twice)
    from deployments.settings import read_yaml  # anchors, aliases and merges read as yaml.safe_load reads them

    aliased = tmp_path / "aliased.yaml"
    aliased.write_text("top: {<<: &mid {<<: {a: 1}, a: 2}, b: 3}\nother: *mid\nlist: [&x {k: 1}, *x]\n")
    assert read_yaml(aliased) == yaml.safe_load(aliased.read_text())
    assert read_yaml(aliased)["list"] == [{"k": 1}, {"k": 1}] and read_yaml(aliased)["other"] == {"a": 2}
    merged = tmp_path / "merged.yaml"  # a merge key still reads as YAML has it: the mapping's own key wins
    merged.write_text("limits:\n  <<: {max_images: 4, max_steps: 9}\n  max_steps: 8\nbuckets: {batch_sizes: [1, 2]}\n")
    config = load_config(config_path=merged)
    assert (config.limits.max_images, config.limits.max_steps) == (4, 8)
    with pytest.raises(ValueError, match="is a directory"):
        load_config(config_path=tmp_path)
    with pytest.raises(FileNotFoundError):
        load_config(config_path=tmp_path / "missing.yaml")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_cuda_asked_for_without_cuda_is_refused_before_anything_starts():
    with pytest.raises(ValueError, match="no CUDA device is visible"):
        resolve_device("cuda")
    with pytest.raises(ValueError, match="runner.mode is 'graph'"):
        runner_mode(ServeConfig(runner=RunnerConfig(mode="graph")))
    with pytest.raises(ValueError, match="no CUDA device"):
        runner_mode(ServeConfig(model=ModelConfig(device="cuda")))
    assert runner_mode(ServeConfig()) == "eager"
    assert BucketConfig().batch_sizes[-1] == 20


def test_the_step_schedulers_settings_have_their_own_section_and_an_old_runner_key_names_its_new_place(tmp_path):
    from bcg_core.runtime_config import SCHEDULER_KEYS, SchedulerConfig

    config = ServeConfig.model_validate({"scheduler": {"max_rows_in_flight": 16, "fair_wait_s": 0.5}})
    assert (config.scheduler.max_rows_in_flight, config.scheduler.fair_wait_s) == (16, 0.5)
    # the keys that moved from runner: (a knob added to the scheduler later is only a SchedulerConfig field)
    assert set(SCHEDULER_KEYS) <= set(SchedulerConfig.model_fields)
    assert not set(SCHEDULER_KEYS) & set(RunnerConfig.model_fields)
    with pytest.raises(ValidationError) as e:
        ServeConfig.model_validate({"runner": {"kernels": "eager", "max_rows_in_flight": 16, "trim_idle_s": None}})
    assert ("runner.max_rows_in_flight moved to scheduler.max_rows_in_flight; runner.trim_idle_s moved to "
            "scheduler.trim_idle_s") in str(e.value)
    old = tmp_path / "old.yaml"  # a config file written before the move: refused when loaded, with the same words
    old.write_text("runner:\n  max_queue_wait_s: 30\n")
    with pytest.raises(Exception, match="runner.max_queue_wait_s moved to scheduler.max_queue_wait_s"):
        load_config(config_path=old)


def test_a_sections_key_written_at_the_top_level_is_pointed_to_its_section():
    from deployments.settings import error_text

    with pytest.raises(ValidationError) as e:
        ServeConfig.model_validate({"max_rows_in_flight": 8, "kernels": "eager", "runer": {}})
    text = error_text(e.value)
    assert "max_rows_in_flight (did you mean 'scheduler.max_rows_in_flight'?)" in text
    assert "kernels (did you mean 'runner.kernels'?)" in text and "runer (did you mean 'runner'?)" in text
