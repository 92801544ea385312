"""Which endpoints hold which prompt prefixes, as a bounded map of block hash -> endpoint bitmask.

Every index the router keeps (its own record of placements here, the engines' KV events in
kv_sources/vllm_events.py) stores one small int per block: a bitmask of the endpoints holding it. Matching a
prompt walks its chained block hashes from the start and notes, for every endpoint, the depth at
which its bit drops out.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence

from dpd_router.pool.endpoint import Endpoint
from dpd_router.routing.request import RoutingRequest

# Distinct endpoint URLs an index tracks before it starts afresh (rolling pods bring new addresses;
# masks would otherwise grow a bit per address ever seen).
MAX_ENDPOINT_URLS = 4096


class EndpointBits:
    """Gives each endpoint URL a bit, so one int holds the set of endpoints that have a block.

    It grows by one entry per distinct endpoint URL ever seen; under discovery, pods that come and go
    with new addresses keep adding URLs, so the index starts afresh past MAX_ENDPOINT_URLS of them.
    """

    def __init__(self) -> None:
        self._index: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._index)

    def bit(self, url: str) -> int:
        index = self._index.get(url)
        if index is None:
            index = self._index[url] = len(self._index)
        return 1 << index

    def mask(self, urls: Iterable[str]) -> int:
        mask = 0
        for url in urls:
            mask |= self.bit(url)
        return mask

    @property
    def everyone(self) -> int:
        return (1 << len(self._index)) - 1


def matched_depths(hashes: Sequence[int], entries: Mapping[int, int], wanted: int) -> dict[int, int]:
    """For each bit of `wanted`, how many leading blocks of `hashes` its endpoint holds (0s omitted)."""
    depths: dict[int, int] = {}
    if not hashes:
        return depths
    alive = wanted
    get = entries.get
    for depth, block in enumerate(hashes):
        held = get(block, 0) & alive
        lost = alive & ~held
        while lost:
            lowest = lost & -lost
            if depth:
                depths[lowest] = depth
            lost ^= lowest
        alive = held
        if not alive:
            return depths
    while alive:
        lowest = alive & -alive
        depths[lowest] = len(hashes)
        alive ^= lowest
    return depths


def prefix_closed_depths(hashes: Sequence[int], entries: Mapping[int, int], wanted: int) -> dict[int, int]:
    """`matched_depths` for an index where every endpoint that holds a block holds every block before it in
    its chain (PrefixIndex: see there): each endpoint's depth found by a binary search, a few lookups each
    rather than a walk of every block (a 20-turn conversation's 850 blocks cost 0.3 ms a match)."""
    depths: dict[int, int] = {}
    if not hashes:
        return depths
    get = entries.get
    last = len(hashes) - 1
    alive = get(hashes[0], 0) & wanted
    whole = get(hashes[last], 0) & alive  # held to the end
    bits = whole
    while bits:
        lowest = bits & -bits
        depths[lowest] = last + 1
        bits ^= lowest
    bits = alive & ~whole
    while bits:
        lowest = bits & -bits
        bits ^= lowest
        # Block 0 is held and block `last` is not: the first block not held is the depth.
        low, high = 1, last
        while low < high:
            middle = (low + high) // 2
            if get(hashes[middle], 0) & lowest:
                low = middle + 1
            else:
                high = middle
        depths[lowest] = low
    return depths


class PrefixIndex:
    """The router's own record of where it sent each prompt prefix: a bounded LRU of block hashes.

    `record` marks every full block of a prompt as held by the endpoints it was sent to; the least
    recently used blocks fall out past `capacity`. A prompt's blocks are touched last block first,
    so its first blocks are the most recent and a prefix is evicted from its tail, never its head: an
    endpoint that holds a block holds every block before it (bits leave a block only with the block), so a
    match searches for where each endpoint's blocks end (prefix_closed_depths).
    About 230 bytes a block, measured (benchmarks/memory.py) (OrderedDict entry, 64-bit key, shared small-int mask).
    """

    name = "prefix"

    def __init__(self, *, block_size: int, capacity: int) -> None:
        if block_size < 1 or capacity < 1:
            raise ValueError("block_size and capacity must be at least 1")
        self.block_size = block_size
        self.capacity = capacity
        self._bits = EndpointBits()
        self._entries: OrderedDict[int, int] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def record(self, request: RoutingRequest, endpoints: Iterable[Endpoint]) -> None:
        """Note that `endpoints` now hold (or are about to compute) the request's prompt."""
        if len(self._bits) > MAX_ENDPOINT_URLS:
            self._bits = EndpointBits()  # losing affinity once beats masks that grow without bound
            self._entries.clear()
        mask = self._bits.mask(endpoint.url for endpoint in endpoints)
        if not mask:
            return
        entries = self._entries
        for block in reversed(request.block_hashes(self.block_size)):
            entries[block] = entries.get(block, 0) | mask
            entries.move_to_end(block)
        overflow = len(entries) - self.capacity
        for _ in range(overflow):
            entries.popitem(last=False)

    def matched_tokens(self, request: RoutingRequest, candidates: Sequence[Endpoint]) -> dict[Endpoint, int]:
        """Tokens of the prompt's prefix the router placed on each candidate (0 for none)."""
        depths = request.memo(self, self._depths)
        bit = self._bits.bit
        return {endpoint: depths.get(bit(endpoint.url), 0) * self.block_size for endpoint in candidates}

    def _depths(self, request: RoutingRequest) -> dict[int, int]:
        return prefix_closed_depths(request.block_hashes(self.block_size), self._entries, self._bits.everyone)
