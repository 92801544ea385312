"""Shadow traffic: copies of chosen requests sent to a second set of engines, timed, and dropped.

`ShadowChoice` (choice.py) decides which requests are copied: by prompt length and by a stable hash,
the same on every replica. `Shadow` (copies.py) queues the copies and sends them from a fixed set of
workers on a session of its own, so the client never waits for the shadow; the metrics of each copy
carry `arm="shadow"` and the shadow's kind as their `path`. `LiveShadow` (live.py) holds the shadow in
force and replaces it when the setting changes on a running router.
"""

from dpd_router.shadow.choice import RecentLengths, ShadowChoice
from dpd_router.shadow.copies import SHADOW_ARM, SHADOW_HEADER, Shadow, ShadowCopy
from dpd_router.shadow.live import LiveShadow

__all__ = ["SHADOW_ARM", "SHADOW_HEADER", "LiveShadow", "RecentLengths", "Shadow", "ShadowChoice", "ShadowCopy"]
