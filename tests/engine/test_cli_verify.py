"""`bcg verify` and `bcg profile` from the command line (CPU: verify runs, profile refuses clearly)."""

import pytest
import torch

from deployments.cli.main import main


@pytest.fixture()
def small_config(tmp_path):
    path = tmp_path / "small.yaml"
    path.write_text('buckets:\n  batch_sizes: [1, 2]\n  resolutions: ["256x256", "320x256"]\n')
    return str(path)


def test_verify_passes_every_bucket_and_names_them(small_config, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "48")  # a narrow terminal: the other columns wrap, the keys read whole
    assert main(["verify", "--config", small_config]) == 0
    out = capsys.readouterr().out
    for key in ("b1_i256_t256", "b2_i320_t256", "b2_i320_m_t256"):
        assert key in out
    assert "6 of 6 buckets passed" in out and "FAIL" not in out


def test_verify_fails_when_the_tolerance_cannot_be_met(small_config, capsys):
    # Masked buckets differ from eager by float reduction order (~1e-7): a zero tolerance must fail them.
    assert main(["verify", "--config", small_config, "--rtol", "1e-30", "--bucket", "b2_i320_m_t256"]) == 1
    assert "FAIL" in capsys.readouterr().out


def test_verify_rejects_an_unknown_bucket(small_config, capsys):
    assert main(["verify", "--config", small_config, "--bucket", "b3_i1_t1"]) == 2
    assert "is not in the table" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_profile_without_cuda_says_it_needs_a_gpu(small_config, capsys):
    assert main(["profile", "--config", small_config]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_a_bad_configuration_is_one_line_per_field_with_the_fix(tmp_path, capsys):
    """Config errors name each field by its path and say what is allowed, on one line, without pydantic's type
    names and links."""
    from deployments.cli.main import main

    bad = tmp_path / "bad.yaml"
    bad.write_text("buckets: {batch_sizes: [2, 1], text_lengths_by_resolution: {'640x640': [32]}}\n"
                   "model: {dtype: int8}\n")
    for command in (["plan"], ["verify"]):
        assert main([*command, "--config", str(bad)]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "errors.pydantic.dev" not in err and "type=" not in err
        assert err.startswith(f"bcg {command[0]}: error: invalid configuration: ")
        assert "model.dtype: Input should be 'float32', 'bfloat16' or 'float16'" in err
        assert "buckets.batch_sizes: batch_sizes [2, 1] must be strictly ascending without repeats; use [1, 2]" in err
    # a misspelt field: the section's fields and the closest one; a bad API key: why, never the key
    bad.write_text("limits: {max_imags: 3}\nauth: {api_keys: [' sk-secret-1 ']}\nmodle: {}\n")
    assert main(["plan", "--config", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert "limits.max_imags: unknown field (did you mean 'max_images'?); limits takes max_images, min_side_px" in err
    assert "modle: unknown field (did you mean 'model'?); the config takes model, buckets, limits" in err
    assert "auth.api_keys.0: an API key that is empty, or padded with white space" in err and "secret" not in err


def test_a_port_something_listens_on_is_refused_before_ray_starts():
    """Serve's proxy binds with SO_REUSEPORT: a second server on a busy port would share it with the first (and a
    keyed server's clients could be answered by an unkeyed one). ``bcg serve``/``bcg demo`` refuse the port first."""
    import socket

    from deployments.cli.local import check_port_free, start_local

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)  # as Serve's proxy binds
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(OSError, match=rf"port {port} on 127.0.0.1 is already in use.*--port"):
            start_local(None, port=port)
    check_port_free(port)  # free again once the listener is gone


def test_a_busy_metrics_port_is_refused_before_ray_starts(capsys):
    import socket

    from deployments.cli.main import main

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["serve", "--port", "0", "--metrics-port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"port {port} on 127.0.0.1 is already in use" in err and "--metrics-port" in err, err
    # one port for both is refused before Ray starts too (nothing listens on it yet)
    assert main(["serve", "--port", str(port), "--metrics-port", str(port)]) == 2
    assert f"--port and --metrics-port are both {port}" in capsys.readouterr().err


def test_demo_steps_above_the_limit_and_a_non_krea_csv_are_refused_before_anything_starts(tmp_path, capsys):
    from deployments.cli.main import main

    assert main(["demo", "--steps", "51"]) == 2
    assert "--steps 51 is above the server's limits.max_steps 50; use --steps 1 to 50" in capsys.readouterr().err
    other = tmp_path / "other.csv"
    other.write_text("foo,bar\n1,2\n")
    assert main(["plan", "--krea", str(other)]) == 2
    assert "is not a krea-format CSV: its header ['foo', 'bar'] lacks ['width', 'height']" in capsys.readouterr().err
