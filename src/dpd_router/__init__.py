"""dpd-router: an OpenAI-compatible gateway for disaggregated prefill/decode serving."""

__version__ = "0.1.0"
