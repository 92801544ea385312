"""`dpd-router demo` as a newcomer meets it: every example its banner prints runs as printed, and a taken port
is refused with the setting that moves it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from dpd_sim.ports import free_port

BIN = Path(sys.executable).parent


def examples(banner: str) -> list[tuple[str, str]]:
    """The banner's titled commands: a line ending with ':' then its lines indented by two spaces."""
    found = []
    lines = banner.splitlines()
    for index, line in enumerate(lines):
        if not line.endswith(":") or line.startswith(" "):
            continue
        block = []
        for following in lines[index + 1 :]:
            if not following.startswith("  "):
                break
            block.append(following)
        if block:
            found.append((line, textwrap.dedent("\n".join(block))))
    return found


def test_every_example_the_demo_prints_runs_as_printed(tmp_path: Path) -> None:
    port = free_port()
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", "PYTHONUNBUFFERED": "1"}
    log = tmp_path / "demo.log"
    with log.open("wb") as out:
        demo = subprocess.Popen(
            [str(BIN / "dpd-router"), "demo", "--port", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,  # a group of its own, which Ctrl-C reaches whole, as in a terminal
        )
    try:
        deadline = time.monotonic() + 120
        while "Press Ctrl-C to stop." not in log.read_text(errors="replace"):
            assert demo.poll() is None, log.read_text(errors="replace")[-3000:]
            assert time.monotonic() < deadline, log.read_text(errors="replace")[-3000:]
            time.sleep(0.2)
        banner = log.read_text(errors="replace")
        ran = {}
        for title, command in examples(banner):
            done = subprocess.run(
                ["bash", "-c", command], capture_output=True, text=True, timeout=60, env=env, check=False
            )
            assert done.returncode == 0 and done.stdout.strip(), (title, command, done.stdout, done.stderr)
            ran[title] = done.stdout
        assert len(ran) == 5, list(ran)
        long, short, openai, anthropic, metrics = ran.values()
        assert "data: [DONE]" in long and '"choices"' in short
        assert openai.strip() and anthropic.strip()
        decisions = [line for line in metrics.splitlines() if line.startswith("dpd_router_route_decisions_total{")]
        assert any('path="disaggregated",reason="long_prompt"' in line for line in decisions), decisions
        assert any('path="direct"' in line for line in decisions), decisions
        assert "disaggregate=True" in log.read_text(errors="replace")
    finally:
        os.killpg(demo.pid, signal.SIGINT)  # Ctrl-C in its terminal, as its banner says
        try:
            demo.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(demo.pid, signal.SIGKILL)
            demo.wait(10)
    assert "stopping the engines" in log.read_text(errors="replace")


@pytest.mark.parametrize("command", ["serve", "demo"])
def test_a_taken_port_is_refused_with_the_setting_that_moves_it(command: str) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        args = [str(BIN / "dpd-router"), command, "--port", str(port)]
        if command == "serve":
            args += ["--decode", "http://127.0.0.1:9"]
        done = subprocess.run(args, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2, done.stderr[-2000:]
    assert f"cannot listen on 127.0.0.1:{port}" in done.stderr and "--port" in done.stderr and "DPD_PORT" in done.stderr
