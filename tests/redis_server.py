"""A real redis-server (Debian's package) on a free loopback port, for the shared limits store's tests."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from dpd_sim.ports import free_port
from tests.tools import required_tool


def redis_server_binary() -> str:
    """The redis-server to run: missing, a CI run fails (.ci/run installs it) and a local one skips."""
    return required_tool("redis-server", package="redis-server", purpose="the shared limits tests")


@dataclass
class RedisServer:
    binary: str
    port: int
    process: asyncio.subprocess.Process | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    async def start(self) -> None:
        """Serving on its port (again, after `kill`): no persistence, loopback only."""
        self.process = process = await asyncio.create_subprocess_exec(
            self.binary,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
        )  # fmt: skip
        async with asyncio.timeout(10):
            while not await _answers(self.port):
                if process.returncode is not None:
                    raise RuntimeError(f"redis-server exited with {process.returncode} on port {self.port}")
                await asyncio.sleep(0.02)

    async def kill(self) -> None:
        """Gone mid-run, as a crashed or unreachable Redis would be."""
        if self.process is not None and self.process.returncode is None:
            self.process.terminate()
            await self.process.wait()


async def _answers(port: int) -> bool:
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        return False
    try:
        writer.write(b"PING\r\n")
        await writer.drain()
        return (await reader.readline()).startswith(b"+PONG")
    finally:
        writer.close()


@asynccontextmanager
async def redis_server() -> AsyncIterator[RedisServer]:
    """A throwaway redis-server on a free loopback port, stopped on exit."""
    server = RedisServer(redis_server_binary(), free_port())
    try:
        await server.start()
        yield server
    finally:
        await server.kill()
