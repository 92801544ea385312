"""LMCache's disaggregated prefill (`LMCacheConnectorV1` with `enable_pd`): the prefiller pushes the KV."""
