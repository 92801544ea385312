from __future__ import annotations

from pathlib import Path

import pytest

from dpd_router.cli import _settings_from, build_parser
from dpd_router.config import SettingsError, load_settings, without_password
from dpd_router.live import LiveConfig
from dpd_router.record.metrics import RouterMetrics


def test_defaults_match_the_managed_service(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DPD_DECODE_URLS", "http://127.0.0.1:9000")
    settings = load_settings()
    assert settings.routing_threshold == 4096
    assert settings.prefill_strategy == "prefixaware"
    assert settings.threshold_mode == "cache_aware"
    assert settings.kv_connector == "nixl"
    assert settings.prefill_urls == []


def test_env_urls_are_comma_separated_and_normalised(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DPD_PREFILL_URLS", "127.0.0.1:8100, http://127.0.0.1:8101/")
    monkeypatch.setenv("DPD_DECODE_URLS", "http://127.0.0.1:8200")
    monkeypatch.setenv("DPD_ROUTING_THRESHOLD", "512")
    settings = load_settings()
    assert settings.prefill_urls == ["http://127.0.0.1:8100", "http://127.0.0.1:8101"]
    assert settings.decode_urls == ["http://127.0.0.1:8200"]
    assert settings.routing_threshold == 512


def test_yaml_file_is_read_and_flags_win_over_env_and_yaml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "router.yaml"
    config.write_text(
        "prefill_urls: [http://127.0.0.1:8100]\n"
        "decode_urls: [http://127.0.0.1:8200]\n"
        "routing_threshold: 1000\n"
        "port: 9001\n"
    )
    monkeypatch.setenv("DPD_CONFIG", str(config))
    monkeypatch.setenv("DPD_PORT", "9002")
    settings = load_settings(routing_threshold=2000)
    assert settings.prefill_urls == ["http://127.0.0.1:8100"]
    assert settings.routing_threshold == 2000  # flag beats YAML
    assert settings.port == 9002  # env beats YAML


def test_cli_flags_repeat_for_several_engines() -> None:
    args = build_parser().parse_args(
        [
            "serve",
            "--prefill", "http://127.0.0.1:8100",
            "--prefill", "http://127.0.0.1:8101",
            "--decode", "http://127.0.0.1:8200",
            "--decode", "http://127.0.0.1:8201",
            "--routing-threshold", "300",
            "--model", "m",
            "--port", "8123",
        ]
    )  # fmt: skip
    settings = _settings_from(args)
    assert settings.prefill_urls == ["http://127.0.0.1:8100", "http://127.0.0.1:8101"]
    assert settings.decode_urls == ["http://127.0.0.1:8200", "http://127.0.0.1:8201"]
    assert (settings.routing_threshold, settings.model, settings.port) == (300, "m", 8123)


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ({"decode_urls": ["http://127.0.0.1:1"], "routing_threshold": 0}, "routing_threshold"),
        ({"decode_urls": ["http://127.0.0.1:1"], "prefill_strategy": "fastest"}, "prefill_strategy"),
        ({"decode_urls": ["ftp://127.0.0.1:1"]}, "decode_urls"),
        ({}, "decode_urls"),
        ({"decode_urls": ["http://127.0.0.1:1"], "tokenizer": "/no/such/dir"}, "tokenizer"),
        ({"decode_urls": ["http://127.0.0.1:1"], "prefill_urls": ["http://127.0.0.1:1"]}, "prefill_urls"),
    ],
)
def test_invalid_settings_fail_with_a_message_naming_the_setting(
    overrides: dict[str, object], named: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("DPD_DECODE_URLS", raising=False)
    with pytest.raises(SettingsError, match=named):
        load_settings(**overrides)


def test_unknown_yaml_key_is_refused(tmp_path: Path) -> None:
    config = tmp_path / "router.yaml"
    config.write_text("decode_urls: [http://127.0.0.1:8200]\nrouting_treshold: 10\n")
    with pytest.raises(SettingsError, match="routing_treshold: unknown setting"):
        load_settings(config=str(config))


def test_missing_config_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="config"):
        load_settings(config=str(tmp_path / "nope.yaml"))


def test_limits_store_takes_a_redis_url_and_is_shown_without_its_password(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DPD_DECODE_URLS", "http://127.0.0.1:9000")
    assert load_settings().limits_store is None
    assert load_settings(limits_store="  ").limits_store is None
    with pytest.raises(SettingsError, match="limits_store"):
        load_settings(limits_store="http://redis:6379")
    url = "redis://router:s3cret@redis.cache:6379/2"
    live = LiveConfig(load_settings(limits_store=url), [], RouterMetrics())
    assert live.effective()["limits_store"] == "redis://<redacted>@redis.cache:6379/2"
    assert without_password("rediss://redis.cache:6380/0") == "rediss://redis.cache:6380/0"
    assert without_password("redis://:p@ss@h:1/0") == "redis://<redacted>@h:1/0"
