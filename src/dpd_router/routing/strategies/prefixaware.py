"""`prefixaware`: a prompt's prefix decides its endpoint, the same on every router worker and replica.

A prompt goes where its own prefix already is; a prefix the router has not placed yet goes to the
endpoint its leading blocks hash to (rendezvous hashing, routing/rendezvous.py), not to whichever
endpoint this process happens to find least loaded. Two replicas with no shared state therefore
send the same new prefix to the same endpoint, and each then finds it where the other put it.
An endpoint out of balance with the lightest candidate (`Balance`) gives way to the least loaded.

The hashed prefix ("the key") is the prompt's first `key_tokens` tokens, whole blocks of the
prefix index's `block_size` (all its full blocks when the prompt is shorter). Why that length:

- It must be a prefix of every turn of a conversation, or the conversation would hash somewhere
  else at each turn. A conversation's first turn that reaches a prefiller is at least
  `routing_threshold` tokens (4096 by default), so a key of 1024 tokens is the same for all its turns.
- It should reach past what many unrelated prompts share: the chat template's header and a short
  system prompt. Hashing only the first block would send every prompt with the same system prompt
  to one endpoint; 1024 tokens take in the start of the conversation itself, so conversations with a
  shorter shared system prompt spread over the endpoints. Conversations sharing a longer system prompt
  share the key, and the one endpoint that holds it serves them until the balance rule spreads them.

A prefix the router's own index places overrides the hash only when it is the prompt's own: at
least as long as the key, or at least half the prompt (a short conversation's earlier turn). A
shorter match is a prefix many prompts share (a system prompt another conversation left there);
each replica knows its own such matches and following them is what split a prefix over several
endpoints. (With `kvaware`, a prefix the engines report counts at any length: every replica hears
the same reports.) Among candidates holding the longest such prefix, the key's rendezvous order
picks, so replicas that know the same holders agree. A match at least as long as the key sits where
the key hashes to anyway, unless the balance rule or a change of the pool put it elsewhere: then the
cache wins, the prefix is there.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from dpd_router.pool.endpoint import Endpoint
from dpd_router.routing.cache import CacheLocator
from dpd_router.routing.load import Balance, load_score
from dpd_router.routing.rendezvous import rendezvous_choice
from dpd_router.routing.request import RoutingRequest
from dpd_router.routing.strategies.base import Strategy
from dpd_router.routing.strategies.leastloaded import LeastLoaded

# The length of the hashed prefix: see the module's docstring.
KEY_TOKENS = 1024


class PrefixAware:
    """The prompt's own cached prefix first, else the rendezvous choice of its key, guarded by `balance`.

    When the chosen endpoint's load is out of balance with the lightest candidate's, the prefix is not
    worth the queue and `fallback` (least loaded) picks among all candidates. A prompt shorter than one
    block has no key and goes to `fallback` too. The cache view is the router's own prefix index.
    Without `hash_new_prefixes` (the decoders' choice), a prefix nobody holds goes to `fallback`.
    """

    name = "prefixaware"

    def __init__(
        self,
        cache: CacheLocator,
        balance: Balance,
        fallback: Strategy | None = None,
        *,
        key_tokens: int = KEY_TOKENS,
        hash_new_prefixes: bool = True,
    ) -> None:
        self.cache = cache
        self._balance = balance
        self._fallback = fallback if fallback is not None else LeastLoaded()
        self._key_blocks = max(1, -(-key_tokens // cache.block_size))
        self._hash_new = hash_new_prefixes

    def tokens_read(self) -> int:
        """The first tokens of a prompt this choice reads (beyond where cached prefixes end): the key,
        and enough to tell that the key is no longer than half the prompt."""
        if not self._hash_new:
            return 0
        return (2 * self._key_blocks - 1) * self.cache.block_size

    def select(self, candidates: Sequence[Endpoint], request: RoutingRequest) -> Endpoint:
        if len(candidates) == 1:
            return candidates[0]
        if not self._hash_new:
            return self._cached_else_least_loaded(candidates, request)
        block_size = self.cache.block_size
        hashes = request.block_hashes(block_size)
        if not hashes:
            return self._fallback.select(candidates, request)
        key_blocks = min(len(hashes), self._key_blocks)
        key = f"{hashes[key_blocks - 1]:016x}"  # chained: it stands for every block up to it
        source, matched = self.cache.locate(request, candidates)
        longest = max(matched.values(), default=0)
        # Engine-reported caches are seen alike by every replica: any match of theirs counts.
        owned = min(key_blocks, (len(hashes) + 1) // 2) * block_size if source is self.cache.index else 1
        eligible = candidates
        if longest >= owned:
            eligible = [endpoint for endpoint in candidates if matched.get(endpoint, 0) == longest]
        chosen = rendezvous_choice(eligible, key)
        now = time.monotonic()
        lightest = min(load_score(endpoint, now) for endpoint in candidates)
        if self._balance.overloaded(load_score(chosen, now), lightest):
            return self._fallback.select(candidates, request)
        return chosen

    def may_choose(self, candidates: Sequence[Endpoint], request: RoutingRequest) -> Sequence[Endpoint]:
        """The decoders' rule (without `hash_new_prefixes`), asked without choosing: the candidates it may
        pick for `request` now. The holders of the longest cached prefix, unless a holder is out of balance
        with the lightest candidate (then the least loaded of all may be picked), or nobody holds any: every
        candidate. With `hash_new_prefixes`, every candidate."""
        if self._hash_new or len(candidates) == 1:
            return candidates
        holders = self._holders(candidates, request)
        if not holders:
            return candidates
        if len(holders) < len(candidates):
            now = time.monotonic()
            lightest = min(load_score(endpoint, now) for endpoint in candidates)
            if any(self._balance.overloaded(load_score(holder, now), lightest) for holder in holders):
                return candidates
        return holders

    def _holders(self, candidates: Sequence[Endpoint], request: RoutingRequest) -> list[Endpoint]:
        """The candidates holding the longest cached prefix of the prompt (of any length); none if nobody
        holds any."""
        _, matched = self.cache.locate(request, candidates)
        longest = max(matched.values(), default=0)
        if longest <= 0:
            return []
        return [endpoint for endpoint in candidates if matched.get(endpoint, 0) == longest]

    def _cached_else_least_loaded(self, candidates: Sequence[Endpoint], request: RoutingRequest) -> Endpoint:
        """The decoders' rule: the longest cached prefix of any length (a decoder holding a shared system
        prompt computes less of the prompt), the least loaded among its holders, and the least loaded of
        all for a prefix nobody holds. A decoder's stream stays on it for the whole answer, so spreading
        by load matters more there than agreeing with other replicas on a new prefix."""
        holders = self._holders(candidates, request)
        if not holders:
            return self._fallback.select(candidates, request)
        chosen = holders[0] if len(holders) == 1 else self._fallback.select(holders, request)
        if len(holders) < len(candidates):
            now = time.monotonic()
            lightest = min(load_score(endpoint, now) for endpoint in candidates)
            if self._balance.overloaded(load_score(chosen, now), lightest):
                return self._fallback.select(candidates, request)
        return chosen
