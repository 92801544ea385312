"""Faults a test can switch on in an engine through `POST /sim/fault`."""

from __future__ import annotations

from typing import Literal, get_args

FaultMode = Literal[
    "none",
    "dead",
    "unhealthy",
    "error_500",
    "hang",
    "no_kv_params",
    "reject_kv",
    "ignore_kv",
    "no_first_tok",
    "no_notification",
    "no_bootstrap",
]
FAULT_MODES: tuple[FaultMode, ...] = get_args(FaultMode)


class FaultInjector:
    """The engine's current fault, for the next `count` requests it applies to (None: no limit).

    - dead: /health and completions answer 503;
    - unhealthy: /health answers 503 while completions are served (an engine too busy for its probes);
    - error_500: completions answer 500 with an OpenAI error body;
    - hang: completions never answer, until the client gives up;
    - no_kv_params: a prefill for a remote decoder answers without kv_transfer_params;
    - reject_kv: a decoder treats any kv_transfer_params as invalid (in-band KV load failure);
    - ignore_kv: a decoder ignores kv_transfer_params and recomputes the prompt (a misconfigured
      connector: vLLM's "Retrieved 0 out of N required tokens");
    - no_first_tok: an LMCache prefill answers with kv_transfer_params but no first_tok;
    - no_notification: an LMCache prefill pushes the KV but no ProxyNotif reaches the router;
    - no_bootstrap: an SGLang prefill never opens its bootstrap room, so its decoder waits and the
      prefill call does not end until the bootstrap wait runs out.
    """

    def __init__(self) -> None:
        self.mode: FaultMode = "none"
        self.remaining: int | None = None

    def set(self, mode: FaultMode, count: int | None = None) -> None:
        self.mode = mode
        self.remaining = count
        if count == 0:
            self.clear()

    def clear(self) -> None:
        self.mode = "none"
        self.remaining = None

    @property
    def dead(self) -> bool:
        return self.mode == "dead"

    @property
    def failing_probes(self) -> bool:
        return self.mode in ("dead", "unhealthy")

    def take(self, *applicable: FaultMode) -> FaultMode | None:
        """Spend one use of the current fault if it applies to this request; return it."""
        if self.mode == "none" or self.mode not in applicable:
            return None
        mode = self.mode
        if self.remaining is not None:
            self.remaining -= 1
            if self.remaining <= 0:
                self.clear()
        return mode

    def describe(self) -> dict[str, object]:
        return {"mode": self.mode, "count": self.remaining}
