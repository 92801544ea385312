"""KV connectors: how the prefill hop hands a prompt's KV cache to the decoder."""
