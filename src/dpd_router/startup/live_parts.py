"""The running parts with live settings that do not take Settings themselves, each behind the
`Reconfigurable` contract (live.py): the threshold gauge, the log level."""

from __future__ import annotations

import logging

from dpd_router.config import Settings
from dpd_router.pool.served_model import ServedModel
from dpd_router.record.metrics import RouterMetrics, model_label


class ThresholdGauge:
    """The routing_threshold gauge of one model: the threshold in force, for dashboards."""

    def __init__(self, metrics: RouterMetrics, model: ServedModel) -> None:
        self._metrics = metrics
        self._model = model
        self._label: str | None = None

    def reconfigure(self, settings: Settings) -> None:
        # Labelled as the model's requests are: a lone model's name learnt from its engines, once it is known
        # (the series under its empty name, if set before, goes).
        label = model_label(self._model.name)
        if self._label is not None and self._label != label:
            self._metrics.routing_threshold.remove(self._label)
        self._label = label
        self._metrics.routing_threshold.labels(label).set(settings.routing_threshold)


class LogLevel:
    """The level of the router's loggers."""

    def reconfigure(self, settings: Settings) -> None:
        logging.getLogger("dpd_router").setLevel(settings.log_level.upper())
