"""API keys: digests in the config, the constant-time check, 401 in OpenAI's shape, and no key in any echo.

The end-to-end tests (401 in OpenAI's shape, no key in any echo) are ``tests/serve/test_api_keys_serve.py``.
"""

from __future__ import annotations

import hmac

import pytest

from deployments.auth import ApiKeys, read_key_file
from deployments.settings import ServeConfig, api_key_digest

CONFIG_KEY = "sk-config-3f9c1a7e5b2d"
FILE_KEY = "sk-file-8e4b6d0c2a19"


def test_config_keeps_digests_only_and_revalidates_them_unchanged():
    cfg = ServeConfig.model_validate({"auth": {"api_keys": [CONFIG_KEY]}})
    dumped = cfg.model_dump(mode="json")
    assert dumped["auth"]["api_keys"] == [api_key_digest(CONFIG_KEY)]
    assert CONFIG_KEY not in repr(cfg) and CONFIG_KEY not in str(dumped)
    assert ServeConfig.model_validate(dumped).auth.api_keys == cfg.auth.api_keys  # a digest stays a digest


def test_a_bad_key_entry_is_refused_without_echoing_any_key():
    with pytest.raises(ValueError) as info:
        ServeConfig.model_validate({"auth": {"api_keys": [CONFIG_KEY, f" {FILE_KEY} ", 7]}})
    text = str(info.value)
    assert "auth.api_keys.1" in text and "<empty, or padded with white space>" in text
    assert "auth.api_keys.2" in text and "<not a string>" in text
    assert FILE_KEY not in text and CONFIG_KEY not in text


def test_key_file_skips_comments_and_blank_lines(tmp_path):
    path = tmp_path / "keys.txt"
    path.write_text(f"# team keys\n\n  {FILE_KEY}  \n{CONFIG_KEY}\n")
    assert read_key_file(path) == [FILE_KEY, CONFIG_KEY]
    (tmp_path / "empty.txt").write_text("# nothing\n\n")
    with pytest.raises(ValueError, match="holds no key"):
        read_key_file(tmp_path / "empty.txt")
    with pytest.raises(ValueError, match="cannot be read"):
        read_key_file(tmp_path / "missing.txt")


def test_check_accepts_known_keys_and_names_missing_and_wrong_ones():
    keys = ApiKeys([api_key_digest(CONFIG_KEY), api_key_digest(FILE_KEY)])
    assert keys.check(f"Bearer {CONFIG_KEY}") is None and keys.check(f"bearer {FILE_KEY}") is None
    assert keys.check(None) == "missing" and keys.check("Bearer ") == "missing" and keys.check("") == "missing"
    assert keys.check(CONFIG_KEY) == "malformed" and keys.check(f"Basic {CONFIG_KEY}") == "malformed"
    from deployments.http_errors import unauthorized_response

    body = unauthorized_response("malformed").body.decode()
    assert "not 'Bearer <key>'" in body and CONFIG_KEY not in body
    assert keys.check("Bearer sk-wrong") == "invalid" and keys.check(f"Bearer {CONFIG_KEY}x") == "invalid"
    assert ApiKeys([]).check(None) is None  # no keys: open
    assert CONFIG_KEY not in repr(keys) and "digests" in repr(keys)


def test_check_compares_with_every_digest_whichever_matches(monkeypatch):
    keys = ApiKeys([api_key_digest(f"k{i}") for i in range(5)])
    calls = []
    real = hmac.compare_digest
    monkeypatch.setattr(hmac, "compare_digest", lambda a, b: calls.append(1) or real(a, b))
    for presented in ("k0", "k4", "nope"):
        calls.clear()
        keys.check(f"Bearer {presented}")
        assert len(calls) == 5, presented  # no early exit on a match


def test_serve_api_key_file_adds_digests_and_a_bad_file_stops_before_ray(tmp_path, capsys):
    from deployments.cli.main import main
    from deployments.cli.serve_command import with_key_file

    path = tmp_path / "keys.txt"
    path.write_text(FILE_KEY + "\n")
    cfg = with_key_file(ServeConfig.model_validate({"auth": {"api_keys": [CONFIG_KEY]}}), str(path))
    assert cfg.auth.api_keys == [api_key_digest(CONFIG_KEY), api_key_digest(FILE_KEY)]
    (tmp_path / "empty.txt").write_text("\n")
    assert main(["serve", "--api-key-file", str(tmp_path / "empty.txt"), "--port", "0"]) == 2
    assert "holds no key" in capsys.readouterr().err
