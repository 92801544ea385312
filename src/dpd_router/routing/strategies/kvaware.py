"""`kvaware`: send a prompt where the engines say its KV already is.

The same choice as `prefixaware`, over a cache view that asks the engines' own reports first: the
per-request LMCache controller answer, then the index built from vLLM KV events. When neither
places any of the prompt on a candidate (not configured, not connected, no answer in time, or
nothing cached), the router's own prefix index decides, exactly as `prefixaware` would, and a
prefix found nowhere goes where its leading blocks hash to. A prefix the engines report counts at any
length, shared system prompt or not: every router replica hears the same reports, so following it
keeps them in agreement.
"""

from __future__ import annotations

from dpd_router.routing.strategies.prefixaware import PrefixAware


class KVAware(PrefixAware):
    """Longest prefix as the cache's engine-reported sources place it, then the router's own index.

    Built with a CacheLocator whose sources are the KV hint (LMCache) and the KV-event index.
    """

    name = "kvaware"
