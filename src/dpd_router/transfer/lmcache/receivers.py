"""Where a prefiller pushes a decoder's KV: that decoder's LMCache PD receiver, named in the prefill's `disagg_spec`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from dpd_router.pool.endpoint import Endpoint


@dataclass(frozen=True)
class Receiver:
    """A decoder's LMCache PD receiver: where the prefiller pushes the KV (one port pair per TP rank)."""

    host: str
    init_ports: tuple[int, ...]
    alloc_ports: tuple[int, ...]

    def spec(self, req_id: str) -> dict[str, Any]:
        return {
            "req_id": req_id,
            "receiver_host": self.host,
            "receiver_init_port": list(self.init_ports),
            "receiver_alloc_port": list(self.alloc_ports),
        }


class ReceiverMap:
    """Which receiver each decoder runs: a per-decoder entry, else the default ports on the decoder's host."""

    def __init__(
        self,
        init_ports: Sequence[int],
        alloc_ports: Sequence[int],
        overrides: Mapping[str, Receiver] | None = None,
    ) -> None:
        self._init_ports = tuple(init_ports)
        self._alloc_ports = tuple(alloc_ports)
        self._overrides = dict(overrides or {})

    def for_decoder(self, decoder: Endpoint) -> Receiver:
        override = self._overrides.get(decoder.url)
        if override is not None:
            return override
        host = urlsplit(decoder.url).hostname or "127.0.0.1"
        return Receiver(host, self._init_ports, self._alloc_ports)
