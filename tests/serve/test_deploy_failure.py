"""A replica that cannot start (a corrupt checkpoint) is reported with its cause, not Ray's generic error."""

import pytest
from ray import serve

from bcg_core import build_tiny, save_pipeline
from deployments.app import build_app
from deployments.cli.local import deploy_failure


@pytest.mark.serve
def test_a_corrupt_checkpoint_is_reported_with_its_cause(serve_apps, tmp_path):
    folder = save_pipeline(build_tiny(), tmp_path / "ckpt")
    for weights in (folder / "transformer").glob("*.safetensors"):
        weights.write_bytes(b"not a safetensors file")
    config = {"model": {"path": str(folder)},
              "buckets": {"batch_sizes": [1, 2], "resolutions": ["256x256"], "text_lengths": [256]}}
    try:
        with pytest.raises(RuntimeError):
            serve.run(build_app({"config": config}), name="bcg-broken", route_prefix="/broken")
        reason = deploy_failure("bcg-broken")
        assert reason.startswith("DiTReplica: ") and "Error" in reason, reason
        assert "safetensors" in reason.lower() or "weights" in reason.lower(), reason
    finally:
        serve.delete("bcg-broken")
