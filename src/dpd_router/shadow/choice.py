"""Which requests the shadow gets a copy of: long enough, and in the chosen share."""

from __future__ import annotations

import bisect
import collections
import math

from dpd_router.config import ShadowSettings
from dpd_router.routing.rendezvous import rendezvous_weight

# A percentile of fewer prompt lengths than this says little: until then no prompt counts as longest.
MIN_LENGTHS = 20

_HASH_RANGE = 2**64


class RecentLengths:
    """The last `window` prompt lengths, kept sorted too, so a percentile is one index away."""

    def __init__(self, window: int) -> None:
        self._window = window
        self._arrived: collections.deque[int] = collections.deque()
        self._sorted: list[int] = []

    def __len__(self) -> int:
        return len(self._sorted)

    def add(self, tokens: int) -> None:
        if len(self._arrived) >= self._window:
            oldest = self._arrived.popleft()
            del self._sorted[bisect.bisect_left(self._sorted, oldest)]
        self._arrived.append(tokens)
        bisect.insort(self._sorted, tokens)

    def percentile(self, percent: float) -> int | None:
        """The length `percent`% of the window are at most (nearest rank); None while it holds too few."""
        count = len(self._sorted)
        if count < MIN_LENGTHS:
            return None
        rank = math.ceil(count * percent / 100)
        return self._sorted[min(max(rank - 1, 0), count - 1)]


class ShadowChoice:
    """Decides per request whether the shadow gets a copy.

    A prompt must be at least `min_prompt_tokens` long and, with `longest_percentile`, longer than
    that percentile of the recent prompts (all prompts this process saw, copied or not). Of those,
    `share` are chosen by a hash of the session key (a conversation is copied whole or not at all,
    so the shadow's prefix cache sees what the live one sees), else of the request id: every
    replica decides the same way for the same request.
    """

    def __init__(self, settings: ShadowSettings) -> None:
        self._min_tokens = settings.min_prompt_tokens
        self._percentile = settings.longest_percentile
        self._lengths = RecentLengths(settings.window) if settings.longest_percentile is not None else None
        self._cutoff = int(settings.share * _HASH_RANGE)

    def eligible(self, prompt_tokens: int) -> bool:
        """Whether the prompt is long enough; with a percentile, it joins the recent lengths."""
        if self._lengths is None or self._percentile is None:
            return prompt_tokens >= self._min_tokens
        longest = self._lengths.percentile(self._percentile)
        self._lengths.add(prompt_tokens)
        return prompt_tokens >= self._min_tokens and longest is not None and prompt_tokens > longest

    def chosen(self, key: str) -> bool:
        """Whether `key` (a session key or request id) falls in the share; the same answer everywhere."""
        if self._cutoff >= _HASH_RANGE:
            return True
        return rendezvous_weight(key, "shadow") < self._cutoff
