"""The running parts with live settings that do not take Settings themselves, each behind the
`Reconfigurable` contract (live.py): the threshold gauge, the log level."""

from __future__ import annotations

import logging

from dpd_router.config import Settings
from dpd_router.metrics import RouterMetrics


class ThresholdGauge:
    """The routing_threshold gauge: the threshold in force, for dashboards."""

    def __init__(self, metrics: RouterMetrics) -> None:
        self._metrics = metrics

    def reconfigure(self, settings: Settings) -> None:
        self._metrics.routing_threshold.set(settings.routing_threshold)


class LogLevel:
    """The level of the router's loggers."""

    def reconfigure(self, settings: Settings) -> None:
        logging.getLogger("dpd_router").setLevel(settings.log_level.upper())
