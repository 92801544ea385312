"""What an engine did, for tests: counters and the last requests it served (`GET /sim/stats`)."""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass
from typing import Any, Literal

RequestKind = Literal["remote_prefill", "kv_decode", "local"]
RequestStatus = Literal["ok", "error", "cancelled", "running"]


@dataclass(slots=True)
class RequestRecord:
    request_id: str
    kind: RequestKind
    prompt_tokens: int
    cached_tokens: int = 0
    status: RequestStatus = "running"
    # The LoRA adapter it ran with (None: the base model).
    adapter: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class RequestLog:
    """Per-engine request counters, and the most recent requests with their outcome."""

    def __init__(self, recent_size: int = 256) -> None:
        self.requests_total = 0
        self.remote_prefills = 0
        self.kv_transfers = 0
        self.local_prefills = 0
        self.failed_transfers = 0
        # POST /tokenize calls: which engines saw a prompt without serving it.
        self.tokenize_requests = 0
        self.recent: deque[RequestRecord] = deque(maxlen=recent_size)

    def open(
        self, request_id: str, kind: RequestKind, prompt_tokens: int, *, model: str | None = None
    ) -> RequestRecord:
        record = RequestRecord(request_id=request_id, kind=kind, prompt_tokens=prompt_tokens, adapter=model)
        self.requests_total += 1
        self.recent.append(record)
        return record

    def counters(self) -> dict[str, int]:
        return {
            "requests_total": self.requests_total,
            "remote_prefills": self.remote_prefills,
            "kv_transfers": self.kv_transfers,
            "local_prefills": self.local_prefills,
            "failed_transfers": self.failed_transfers,
            "tokenize_requests": self.tokenize_requests,
        }
