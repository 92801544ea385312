"""The real-engine harness's ports: chosen outside the kernel's ephemeral range, a stolen one noticed at once.

CI once lost a whole `make test-vllm` run to a NIXL side-channel port that another process bound
between the harness choosing it and the engine binding it: the engine's listener thread died, the
engine never became healthy, and every test waited out the 600 s start-up timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import socket
import sys
from pathlib import Path

import pytest

from dpd_sim import ports as port_module
from dpd_sim import vllm_cpu
from dpd_sim.ports import ephemeral_range, free_ports
from dpd_sim.vllm_cpu import Engine, Layout, PortTaken, Role, VllmPair


def test_ports_come_from_below_the_ephemeral_range_distinct_and_bindable() -> None:
    low, _ = ephemeral_range()
    ports = free_ports(6, rng=random.Random(7))
    assert len(set(ports)) == 6
    assert all(10000 <= port < low for port in ports)
    for port in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", port))


def test_a_port_in_use_or_already_given_is_not_chosen(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(port_module, "ephemeral_range", lambda: (12000, 60999))
    held: list[socket.socket] = []
    try:
        for port in range(10000, 10010):  # hold what we can of a small slice of the candidates
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                sock.close()
                continue
            sock.listen()
            held.append(sock)
        held_ports = {sock.getsockname()[1] for sock in held}
        given = set(range(10010, 10100))
        ports = free_ports(40, taken=given, rng=random.Random(1))
        assert len(set(ports)) == 40
        assert not set(ports) & held_ports
        assert not set(ports) & given
        assert all(10000 <= port < 12000 for port in ports)
    finally:
        for sock in held:
            sock.close()


_FAKE_ENGINE = """
import http.server, pathlib, sys
port, marker = int(sys.argv[1]), pathlib.Path(sys.argv[2])
if not marker.exists():  # the first start loses its port, as vLLM's NIXL listener did in CI
    marker.write_text("x")
    print("zmq.error.ZMQError: Address already in use (addr='tcp://127.0.0.1:1')", flush=True)
    import time
    time.sleep(600)

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass

http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


class _FakePair(VllmPair):
    """A VllmPair whose engines are small Python processes: the prefill one loses its port once."""

    def __init__(self, root: Path) -> None:
        self.root = root
        layout = Layout(root=root)
        layout.python.parent.mkdir(parents=True)
        layout.python.symlink_to(sys.executable)
        layout.marker.write_text(vllm_cpu.RECIPE + "\n")
        self.starts: list[tuple[Role, int]] = []
        super().__init__("nixl", layout=layout, log_dir=root / "logs", tokenizer_dir=root / "tokenizer")

    def _engine(self, role: Role, *, cpu: int) -> Engine:
        (port,) = free_ports(1, taken=self.used_ports)
        self.used_ports.add(port)
        self.starts.append((role, port))
        marker = self.root / ("prefill-failed-once" if role == "prefill" else "decode-never-fails")
        if role == "decode":
            marker.write_text("x")
        return Engine(
            role=role,
            port=port,
            cpu=cpu,
            command=[sys.executable, "-c", _FAKE_ENGINE, str(port), str(marker)],
            env=dict(os.environ),
            log_path=self.log_dir / f"{role}.log",
        )


async def test_an_engine_that_loses_its_port_fails_fast_and_the_pair_starts_again_on_new_ports(
    tmp_path: Path, tokenizer_dir: Path
) -> None:
    (tmp_path / "tokenizer").symlink_to(tokenizer_dir)
    pair = _FakePair(tmp_path)
    pair.startup_timeout = 60.0
    try:
        await pair.start()
        assert [role for role, _ in pair.starts] == ["prefill", "decode", "prefill", "decode"]
        first, second = {p for _, p in pair.starts[:2]}, {p for _, p in pair.starts[2:]}
        assert not first & second
        assert {pair.prefill.port, pair.decode.port} == second
        assert pair.prefill.alive and pair.decode.alive
        assert "Address already in use" in pair.prefill.log_text()  # the first attempt's, kept in the log
        assert "Address already in use" not in pair.prefill.log_since_spawn()
    finally:
        await pair.stop()


async def test_port_taken_is_reported_within_seconds_not_after_the_startup_timeout(tmp_path: Path) -> None:
    (port,) = free_ports(1)
    marker = tmp_path / "absent"
    engine = Engine(
        role="prefill",
        port=port,
        cpu=0,
        command=[sys.executable, "-c", _FAKE_ENGINE, str(port), str(marker)],
        env=dict(os.environ),
        log_path=tmp_path / "engine.log",
    )
    engine.spawn()
    try:
        with pytest.raises(PortTaken, match="could not bind a port"):
            await asyncio.wait_for(engine.wait_healthy(within=600.0), timeout=60.0)
    finally:
        with contextlib.suppress(Exception):
            await engine.stop(grace=5.0)
