"""HTTP surface: the OpenAI-compatible API and the operator endpoints."""
