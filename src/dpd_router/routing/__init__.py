"""Routing decisions: which path a request takes, and which engines serve it."""
