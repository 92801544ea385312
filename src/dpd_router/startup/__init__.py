"""Startup: the router's components, built once from the settings (`components.Components.start`) and closed at
shutdown; a background task's end (`tasks.py`). Nothing is imported here, so a module that needs only `tasks`
does not load the components."""
