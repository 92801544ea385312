"""A simulated vLLM engine for dpd-router: vLLM's HTTP formats, NIXL lease semantics, a GPU timing model.

It stands in for real engines in tests and benchmarks, and is strict where vLLM is: a decoder
given missing, reused or expired `kv_transfer_params` fails the request in-band. Nothing here
imports the router, and the router never imports this package: only its command line does, to start
engines for `dpd-router demo` and `dpd-router sim` (tests/unit/test_package_boundary.py holds both to it).
"""

from dpd_sim.cluster import SimCluster, SimEngine
from dpd_sim.config import Role, SimConfig
from dpd_sim.engine import create_app, main
from dpd_sim.gpu import Scheduler, StepRecord, TimingModel
from dpd_sim.tokenizer_kit import ensure_tokenizer

__all__ = [
    "Role",
    "Scheduler",
    "SimCluster",
    "SimConfig",
    "SimEngine",
    "StepRecord",
    "TimingModel",
    "create_app",
    "ensure_tokenizer",
    "main",
]
