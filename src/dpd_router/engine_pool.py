"""Where the engine pool was before it moved to `dpd_router.pool.engine_pool`: the workplace's floor benchmark
(../shared/bench/floor_proxy.py, outside this project) imports `EnginePool` from here."""

from dpd_router.pool.engine_pool import EnginePool

__all__ = ["EnginePool"]
