"""The gateway: serves a planned request over its prefill and decode hops (handler.py reads top to bottom).

The package's public names are the ones the server builds and the HTTP edge consumes.
"""

from dpd_router.gateway.answer import Answer, StreamedAnswer, WholeAnswer
from dpd_router.gateway.handler import Gateway
from dpd_router.gateway.policy import PhaseTimeouts, RetryPolicy

__all__ = ["Answer", "Gateway", "PhaseTimeouts", "RetryPolicy", "StreamedAnswer", "WholeAnswer"]
