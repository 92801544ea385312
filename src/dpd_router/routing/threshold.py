"""The threshold decision: is a prompt's prefill worth a hop to a prefiller?

`static` compares the whole prompt with `routing_threshold`. `cache_aware` compares what the
chosen decoder would still have to compute (the prompt minus the prefix it already holds), so a
long prompt whose prefix sits on the decoder goes direct. The prefill-busy gate sends prompts
straight to the decoder when every prefiller's queue is deep, up to a hard ceiling.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from dpd_router.config import ThresholdMode
from dpd_router.pool.endpoint import Endpoint


@dataclass(frozen=True)
class Threshold:
    """Prompt tokens (uncached tokens, in `cache_aware` mode) at or above which a request is disaggregated."""

    tokens: int
    mode: ThresholdMode

    @property
    def cache_aware(self) -> bool:
        """Whether the decision looks at the decoder's cached prefix (cache_aware and adaptive do)."""
        return self.mode in ("cache_aware", "adaptive")

    def uncached_tokens(self, prompt_tokens: int, cached_tokens: int) -> int:
        """The prompt tokens the decoder would compute itself; the whole prompt in `static` mode."""
        if not self.cache_aware:
            return prompt_tokens
        return prompt_tokens - min(max(cached_tokens, 0), prompt_tokens)


@dataclass(frozen=True)
class PrefillBusyGate:
    """Closed when every prefiller's engine queue is deeper than `queue_depth`.

    Then prompts with fewer than `max_tokens` uncached tokens go direct rather than queueing behind
    the prefill pool; longer ones still wait for a prefiller. `max_tokens` 0 disables the gate.
    Only fresh scraped queues count: a pool whose load is unknown is never called busy.
    """

    queue_depth: int
    max_tokens: int

    def diverts(self, prefillers: Sequence[Endpoint], uncached_tokens: int) -> bool:
        if self.max_tokens <= 0 or uncached_tokens >= self.max_tokens or not prefillers:
            return False
        now = time.monotonic()
        for prefiller in prefillers:
            load = prefiller.fresh_load(now)
            if load is None or load.waiting <= self.queue_depth:
                return False
        return True
