"""The listener's connections, whatever socket they were accepted on."""

from __future__ import annotations

import socket
from pathlib import Path

import httpx

from dpd_router.app import build_server
from dpd_router.config import load_settings
from dpd_router.supervisor import bind
from dpd_sim.cluster import SimCluster
from tests.integration.conftest import chat_body, cluster_settings, serving


async def test_a_supervisors_socket_serves_kept_alive_connections_without_nagle(
    cluster: SimCluster, tokenizer_dir: Path
) -> None:
    """The supervisor's listener (socket.socket(), no protocol named) on asyncio's loop: asyncio leaves
    Nagle's algorithm on for what it accepts there, so the router turns it off on each connection."""
    sock = bind("127.0.0.1", 0)
    port = sock.getsockname()[1]
    settings = load_settings(host="127.0.0.1", port=port, **cluster_settings(cluster, tokenizer_dir, threshold=64))
    async with (
        serving(build_server(settings, loop="none", lifespan="on"), sock) as server,
        httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as client,
    ):
        for _ in range(3):
            assert (await client.post("/v1/chat/completions", json=chat_body("Hi"))).status_code == 200
        options = [
            connection.transport.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
            for connection in server.server_state.connections
        ]
    assert options and all(options)
