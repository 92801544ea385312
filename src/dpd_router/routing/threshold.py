"""The threshold decision: is a prompt's prefill worth a hop to a prefiller?

`static` compares the whole prompt with `routing_threshold`. `cache_aware` compares what the
chosen decoder would still have to compute (the prompt minus the prefix it already holds), so a
long prompt whose prefix sits on the decoder goes direct. The prefill-busy gate sends prompts
straight to the decoder when every prefiller's queue is deep, up to a hard ceiling.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
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
    """Closed when every prefiller's engine queue is deeper than `queue_depth` waiting requests.

    Then prompts with fewer than `max_tokens` uncached tokens go direct rather than queueing behind
    the prefill pool; longer ones still wait for a prefiller. `max_tokens` 0 disables the gate.
    Only fresh scraped queues count: a pool whose load is unknown is never called busy.

    Adaptive mode measures the queue in prompt tokens instead (`diverts_by_tokens`, closed above
    `queue_tokens`): its model already prices a queue by its tokens, and a request count would
    close the gate on a burst of short prompts the model sent to an idle prefiller, sending the
    next long prompts onto the decoder. Its ceiling counts the decoder's streams too: a prompt is
    diverted only while its tokens times the streams its prefill would stall (at least 1) stay
    below `max_tokens`. An idle decoder takes what the static gate would send it; a decoder full
    of streams takes only short prompts, and longer ones are left to the model, which weighs the
    saturated queue's wait against the stall (a 16k-token prompt diverted onto 10 streams stalls
    each for its whole prefill).
    """

    queue_depth: int
    max_tokens: int
    queue_tokens: int = 0

    def diverts(self, prefillers: Sequence[Endpoint], uncached_tokens: int) -> bool:
        if not self._applies(prefillers, uncached_tokens):
            return False
        now = time.monotonic()
        for prefiller in prefillers:
            load = prefiller.fresh_load(now)
            if load is None or load.waiting <= self.queue_depth:
                return False
        return True

    def diverts_by_tokens(
        self,
        prefillers: Sequence[Endpoint],
        uncached_tokens: int,
        queued: Callable[[Endpoint], float],
        decoder_streams: float,
    ) -> bool:
        """Closed when every prefiller has more than `queue_tokens` prompt tokens queued (`queued`);
        it diverts a prompt only while `uncached_tokens` times `decoder_streams` (at least 1) stays
        below `max_tokens`."""
        if self.queue_tokens <= 0 or not self._applies(prefillers, uncached_tokens * max(decoder_streams, 1.0)):
            return False
        return all(queued(prefiller) > self.queue_tokens for prefiller in prefillers)

    def _applies(self, prefillers: Sequence[Endpoint], uncached_tokens: float) -> bool:
        return self.max_tokens > 0 and uncached_tokens < self.max_tokens and bool(prefillers)
