"""Endpoint selection policies, one a file, each behind `Strategy.select(candidates, request)`."""

from dpd_router.routing.rendezvous import rendezvous_weight
from dpd_router.routing.strategies.base import Strategy
from dpd_router.routing.strategies.kvaware import KVAware
from dpd_router.routing.strategies.leastloaded import LeastLoaded
from dpd_router.routing.strategies.prefixaware import PrefixAware
from dpd_router.routing.strategies.roundrobin import RoundRobin
from dpd_router.routing.strategies.session import Session

__all__ = ["KVAware", "LeastLoaded", "PrefixAware", "RoundRobin", "Session", "Strategy", "rendezvous_weight"]
