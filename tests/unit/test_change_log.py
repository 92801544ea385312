"""The workers' change log (change_log.py) and LiveConfig following it: two workers' LiveConfigs share a
real file here, as `serve --workers N` workers do (the processes themselves: integration/test_workers.py)."""

from __future__ import annotations

import stat
import subprocess
import sys
from pathlib import Path

import pytest

from dpd_router import change_log
from dpd_router.change_log import ChangeLog, Entry, settings_json
from dpd_router.config import Settings, load_settings, updated_settings
from dpd_router.live import ConfigRejected, LiveConfig
from dpd_router.record.metrics import RouterMetrics

DECODERS = ["http://127.0.0.1:9000"]


@pytest.fixture
def log_path(tmp_path: Path) -> Path:
    directory = tmp_path / "changes"
    directory.mkdir(mode=0o700)
    return change_log.create(directory)


def test_the_log_is_created_empty_and_readable_by_its_owner_alone(log_path: Path) -> None:
    assert log_path.read_bytes() == b""
    assert stat.S_IMODE(log_path.stat().st_mode) == 0o600
    with pytest.raises(FileExistsError):  # never reused: a supervisor starts its own
        change_log.create(log_path.parent)


def test_each_reader_gets_every_line_once_in_the_order_written(log_path: Path) -> None:
    first, second = ChangeLog(log_path, pid=1), ChangeLog(log_path, pid=2)
    first.append_changes({"routing_threshold": 10})
    second.append_changes({"routing_threshold": 20})
    assert first.has_news()
    assert first.read_new() == [Entry(1, {"routing_threshold": 10}), Entry(2, {"routing_threshold": 20})]
    assert not first.has_news() and first.read_new() == []
    first.append_reload()
    second.append_changes({"max_queued": 3})
    assert first.read_new() == [Entry(1, None), Entry(2, {"max_queued": 3})]
    assert [entry.pid for entry in second.read_new()] == [1, 2, 1, 2]


def test_a_worker_starting_takes_the_changes_after_the_last_reload_marker(log_path: Path) -> None:
    worker = ChangeLog(log_path, pid=1)
    assert ChangeLog(log_path, pid=9).read_since_last_reload() == []
    worker.append_changes({"routing_threshold": 10})
    assert ChangeLog(log_path, pid=9).read_since_last_reload() == [Entry(1, {"routing_threshold": 10})]
    worker.append_reload()
    ChangeLog(log_path, pid=2).append_reload()
    assert ChangeLog(log_path, pid=9).read_since_last_reload() == []
    worker.append_changes({"routing_threshold": 30})
    worker.append_changes({"max_queued": 5})
    starting = ChangeLog(log_path, pid=9)
    assert starting.read_since_last_reload() == [
        Entry(1, {"routing_threshold": 30}),
        Entry(1, {"max_queued": 5}),
    ]
    assert starting.read_new() == [], "it follows from the end"


def test_a_line_still_being_written_is_read_once_whole(log_path: Path) -> None:
    reader = ChangeLog(log_path, pid=2)
    ChangeLog(log_path, pid=1).append_changes({"routing_threshold": 10})
    with log_path.open("ab") as file:
        file.write(b'{"pid": 1, "changes": {"routing_thr')
    assert reader.read_new() == [Entry(1, {"routing_threshold": 10})]
    assert reader.has_news() and reader.read_new() == []  # the torn line waits
    with log_path.open("ab") as file:
        file.write(b'eshold": 20}}\n')
    assert reader.read_new() == [Entry(1, {"routing_threshold": 20})]


def test_a_line_that_is_not_a_change_is_skipped_and_logged(log_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with log_path.open("ab") as file:
        file.write(b'not json\n{"pid": "x", "changes": {}}\n["a list"]\n{"pid": 1, "changes": {"max_queued": 2}}\n')
    assert ChangeLog(log_path, pid=2).read_new() == [Entry(1, {"max_queued": 2})]
    assert caplog.text.count("has a line that is not a change") == 3


def test_settings_json_writes_the_shadows_secrets_in_clear_for_the_siblings() -> None:
    shadow = {"url": "http://shadow:8000", "api_key": "sk-shadow", "headers": {"X-Tenant": "t-secret"}}
    settings = load_settings(decode_urls=DECODERS, shadow=shadow, routing_threshold=77)
    values = settings_json(settings, {"shadow", "routing_threshold"})
    assert values["routing_threshold"] == 77
    assert values["shadow"]["api_key"] == "sk-shadow" and values["shadow"]["headers"] == {"X-Tenant": "t-secret"}
    rebuilt = updated_settings(load_settings(decode_urls=DECODERS), values)
    assert rebuilt.shadow == settings.shadow and rebuilt.routing_threshold == 77


def worker(settings: Settings, log_path: Path, pid: int) -> tuple[LiveConfig, RouterMetrics]:
    metrics = RouterMetrics()
    return LiveConfig(settings, [], metrics, ChangeLog(log_path, pid=pid)), metrics


def reloads(metrics: RouterMetrics, source: str, outcome: str) -> float:
    return metrics.config_reloads.labels(source, outcome)._value.get()


async def test_a_put_to_one_worker_reaches_its_sibling_as_a_peer_change(log_path: Path) -> None:
    settings = load_settings(decode_urls=DECODERS)
    first, first_metrics = worker(settings, log_path, 1)
    second, second_metrics = worker(settings, log_path, 2)
    changed = await first.update({"routing_threshold": 1234}, source="admin")
    assert changed == {"routing_threshold": {"from": settings.routing_threshold, "to": 1234}}
    assert first.settings.routing_threshold == 1234 and second.settings.routing_threshold != 1234
    await second.apply_peer_changes()
    assert second.settings.routing_threshold == 1234
    assert reloads(first_metrics, "admin", "applied") == 1 and reloads(first_metrics, "peer", "applied") == 0
    assert reloads(second_metrics, "peer", "applied") == 1 and reloads(second_metrics, "admin", "applied") == 0


async def test_racing_puts_to_two_workers_end_the_same_on_both(log_path: Path) -> None:
    settings = load_settings(decode_urls=DECODERS)
    first, _ = worker(settings, log_path, 1)
    second, _ = worker(settings, log_path, 2)
    # Each applies its own before reading the other's: the log's order decides, for both.
    await first.update({"routing_threshold": 111})
    changed = await second.update({"routing_threshold": 222})
    assert changed == {"routing_threshold": {"from": 111, "to": 222}}
    await first.apply_peer_changes()
    assert first.settings.routing_threshold == second.settings.routing_threshold == 222


async def test_a_refused_put_is_not_written(log_path: Path) -> None:
    first, _ = worker(load_settings(decode_urls=DECODERS), log_path, 1)
    with pytest.raises(ConfigRejected):
        await first.update({"routing_threshold": -1})
    with pytest.raises(ConfigRejected, match="restart"):
        await first.update({"decode_urls": ["http://elsewhere:1"]})
    assert not ChangeLog(log_path, pid=2).has_news()


async def test_a_reload_leaves_a_marker_and_a_worker_starting_later_matches_its_siblings(
    log_path: Path, tmp_path: Path
) -> None:
    config = tmp_path / "router.yaml"
    config.write_text("decode_urls: [http://127.0.0.1:9000]\nrouting_threshold: 500\n")
    settings = load_settings(config=str(config))
    first, _ = worker(settings, log_path, 1)
    await first.update({"routing_threshold": 600, "max_queued": 7})
    started, _ = worker(load_settings(config=str(config)), log_path, 3)
    await started.replay_changes()
    assert (started.settings.routing_threshold, started.settings.max_queued) == (600, 7)

    config.write_text("decode_urls: [http://127.0.0.1:9000]\nrouting_threshold: 700\n")
    await first.reload("sighup")
    assert (first.settings.routing_threshold, first.settings.max_queued) == (700, settings.max_queued)
    await first.update({"max_queued": 9})
    later, _ = worker(load_settings(config=str(config)), log_path, 4)
    await later.replay_changes()
    assert (later.settings.routing_threshold, later.settings.max_queued) == (700, 9)


async def test_a_reload_first_applies_the_siblings_changes_written_before_it(log_path: Path, tmp_path: Path) -> None:
    config = tmp_path / "router.yaml"
    config.write_text("decode_urls: [http://127.0.0.1:9000]\nrouting_threshold: 500\n")
    first, _ = worker(load_settings(config=str(config)), log_path, 1)
    second, _ = worker(load_settings(config=str(config)), log_path, 2)
    await first.update({"routing_threshold": 600})
    config.write_text("decode_urls: [http://127.0.0.1:9000]\nrouting_threshold: 800\n")
    # The second reloads before it has read the first's PUT: the PUT came first, so the file wins.
    await second.reload("sighup")
    await first.reload("sighup")
    await second.apply_peer_changes()
    assert first.settings.routing_threshold == second.settings.routing_threshold == 800


def test_a_single_process_router_has_no_log(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(change_log.CHANGE_LOG_ENV, raising=False)
    assert ChangeLog.from_environment() is None


async def test_a_put_is_still_applied_here_when_the_log_cannot_be_written(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    alone, metrics = worker(load_settings(decode_urls=DECODERS), tmp_path / "gone" / change_log.FILE_NAME, 1)
    changed = await alone.update({"routing_threshold": 1234})
    assert changed["routing_threshold"]["to"] == 1234 and alone.settings.routing_threshold == 1234
    assert reloads(metrics, "admin", "applied") == 1
    assert "this change is this worker's alone" in caplog.text


def test_a_worker_asks_only_its_own_living_supervisor_to_reload_everyone(tmp_path: Path) -> None:
    path = change_log.create(tmp_path)
    # Not this process's parent (an orphaned worker's former supervisor, or anyone else): never signalled.
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert not ChangeLog(path, supervisor=stranger.pid).reload_every_worker()
        assert stranger.poll() is None  # a SIGHUP would have ended it
    finally:
        stranger.kill()
        stranger.wait()
    assert not ChangeLog(path, supervisor=None).reload_every_worker()
