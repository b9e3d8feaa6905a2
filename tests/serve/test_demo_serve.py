"""``bcg demo`` against the session's running application (``serve_apps``); the demo's pure parts are
``tests/unit/test_demo.py``."""

from __future__ import annotations

import pytest

HEADER = "prompt,width,height,num_step,cfg_scale,seed,num_generations,is_grid,timestamp,sampler_flag,image_uri\n"


@pytest.mark.serve
def test_demo_against_running_app_writes_pngs_reports_failures_and_prints_the_table(serve_apps, tmp_path, capsys):
    from deployments.cli.demo import run_demo

    data = tmp_path / "two.csv"
    data.write_text(HEADER + "a red fox in snow,256,256,,,3000000007.0,1.0,,,,x\n"
                             "a size off the 16-pixel grid,264,256,,,1.0,1.0,,,,x\n")
    out = tmp_path / "pngs"
    status = run_demo(url=serve_apps.base_url, data=data, requests=2, steps=1, out=out, timeout_s=60)
    text = capsys.readouterr().out
    assert status == 1  # one request failed
    assert sorted(p.name for p in out.iterdir()) == ["req001_img1.png"]
    assert (out / "req001_img1.png").read_bytes().startswith(b"\x89PNG")
    assert "failed req002 (data row 1, 264x256, n=1): HTTP 422" in text
    assert "b2_i256_t256" in text  # 1 image with CFG = 2 rows, 256x256 = 256 tokens of 16x16 px
    assert "2 requests (1 ok, 1 failed), 1 image in" in text
