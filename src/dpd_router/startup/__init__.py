"""Startup: the router's components, built once from the settings (`Components.start`) and closed at shutdown."""

from dpd_router.startup.components import Components

__all__ = ["Components"]
