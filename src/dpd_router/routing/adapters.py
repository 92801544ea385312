"""The planners of LoRA adapters: one per pool and adapter, made on the adapter's first request.

An adapter's two hops must both run with it, or the KV the decoder receives was computed with other
weights: its planner sees only the engines that list the adapter (`Planner.for_adapter`). Adapters are
the ones the engines list (gateway/models.py refuses any other name), and the planners kept are bounded:
the least recently used is dropped first (it is made again, with an empty prefix index, when needed).
"""

from __future__ import annotations

from collections import OrderedDict

from dpd_router.config import Settings
from dpd_router.routing.planner import Planner

# Planners kept, over every pool and adapter.
MAX_ADAPTER_PLANNERS = 1024


class AdapterPlanners:
    """Each adapter's planner over a model's pool, following the model's live routing settings."""

    def __init__(self, settings: Settings, *, capacity: int = MAX_ADAPTER_PLANNERS) -> None:
        self._settings = settings
        self._capacity = capacity
        # (the base planner's id, the adapter) -> its planner; base planners live as long as the process.
        self._planners: OrderedDict[tuple[int, str], Planner] = OrderedDict()

    def __len__(self) -> int:
        return len(self._planners)

    def planner_for(self, base: Planner, adapter: str) -> Planner:
        key = (id(base), adapter)
        planner = self._planners.get(key)
        if planner is None:
            planner = self._planners[key] = base.for_adapter(adapter, self._settings)
            if len(self._planners) > self._capacity:
                self._planners.popitem(last=False)
        else:
            self._planners.move_to_end(key)
        return planner

    def reconfigure(self, settings: Settings) -> None:
        self._settings = settings
        for planner in self._planners.values():
            planner.reconfigure(settings)
