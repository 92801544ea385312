"""The supervisor of `serve --workers N` replacing dead workers (real processes: integration/test_workers.py)."""

from __future__ import annotations

import socket
from pathlib import Path

from dpd_router.config import load_settings
from dpd_router.supervisor import MAX_BACKOFF, STABLE_AFTER, Slot, Supervisor


class DeadProcess:
    pid = 4242
    exitcode = 1

    def join(self) -> None:
        pass


def test_a_dead_worker_is_replaced_later_each_time_it_dies_young_and_its_live_gauges_are_dropped(
    tmp_path: Path,
) -> None:
    settings = load_settings(decode_urls=["http://decoder:8000"], workers=2)
    with socket.socket() as sock:
        supervisor = Supervisor(settings, sock, str(tmp_path))
        slot = Slot(0)
        delays = []
        now = 1000.0
        for _ in range(9):
            (tmp_path / f"gauge_livesum_{DeadProcess.pid}.db").write_bytes(b"")
            slot.process, slot.started_at = DeadProcess(), now  # type: ignore[assignment]  # a stand-in
            now += 1.0
            supervisor._reap(slot, now)
            assert slot.process is None and slot.restart_at is not None
            delays.append(slot.restart_at - now)
            assert not (tmp_path / f"gauge_livesum_{DeadProcess.pid}.db").exists()
        assert delays == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, MAX_BACKOFF, MAX_BACKOFF, MAX_BACKOFF]
        slot.process, slot.started_at = DeadProcess(), now  # type: ignore[assignment]
        supervisor._reap(slot, now + STABLE_AFTER)
        assert slot.restart_at == now + STABLE_AFTER, "a worker that ran a while is replaced at once"
        assert slot.backoff == 0.5
