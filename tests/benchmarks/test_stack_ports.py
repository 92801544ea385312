"""A benchmark's server whose chosen port was taken before it bound it starts again on another."""

from __future__ import annotations

import asyncio
import socket
import sys

import httpx

from benchmarks import stack
from dpd_sim.ports import HOST, free_port


def test_a_service_whose_port_was_taken_starts_on_a_fresh_one() -> None:
    async def main() -> None:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
            taken.bind((HOST, free_port()))
            taken.listen()
            port = taken.getsockname()[1]
            argv = [sys.executable, "-m", "http.server", str(port), "--bind", HOST]
            service = stack.Service("http-server", argv, port, ready_path="/")
            try:
                await service.start(wait=30.0)
                assert service.port != port
                assert service.argv[3] == str(service.port)
                async with httpx.AsyncClient() as client:
                    assert (await client.get(service.url + "/")).status_code == 200
            finally:
                await service.stop()

    asyncio.run(main())


def test_a_service_that_fails_for_another_reason_is_not_started_again() -> None:
    async def main() -> None:
        service = stack.Service("broken", [sys.executable, "-c", "raise SystemExit(3)"], free_port())
        try:
            await service.start(wait=30.0)
        except RuntimeError as exc:
            assert "exited with 3" in str(exc)
        else:
            raise AssertionError("a process that exits was reported started")

    asyncio.run(main())
