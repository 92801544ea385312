"""A client that leaves before its answer is complete stops the work done for it.

The router's listener (server.py) calls the function a request's scope holds under `ON_LOST` when the
connection is lost before the response completed: a callback from the protocol, with no task per request
waiting for the disconnect. Served by another ASGI server, a request is watched by a task that waits for
`http.disconnect` instead (what Starlette's streaming response does, with a task group around it).
"""

from __future__ import annotations

import asyncio

from starlette.types import Receive, Scope

# The scope key the listener reads when a connection is lost; present (None) where the listener calls it.
ON_LOST = "dpd_router.on_lost"


class Departure:
    """Cancels the task serving a request when its client leaves, until `stop()` (once the answer is sent).

    Watch once the body has been read: before that, a disconnect ends the body's read itself.
    `left` says whether the cancellation came from here, which the server's own cancellation does not.
    """

    __slots__ = ("_scope", "_task", "_watcher", "left")

    def __init__(self, scope: Scope, receive: Receive) -> None:
        self._scope = scope
        self._task: asyncio.Task[object] | None = asyncio.current_task()
        self._watcher: asyncio.Future[None] | None = None
        self.left = False
        if ON_LOST in scope:
            scope[ON_LOST] = self._lost
        else:
            self._watcher = asyncio.ensure_future(self._watch(receive))

    def _lost(self) -> None:
        task, self._task = self._task, None
        if task is not None and not task.done():
            self.left = True
            task.cancel()

    async def _watch(self, receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self._lost()

    def absorb(self) -> None:
        """The cancellation it caused has been handled (the request is over): the task that caught it goes on
        as one never cancelled (a timeout or task group later in it would read the count)."""
        if self.left and (task := asyncio.current_task()) is not None and task.cancelling():
            task.uncancel()

    def stop(self) -> None:
        """The answer is complete (or the request over): a disconnect from now on cancels nothing."""
        self._task = None
        if self._watcher is not None:
            self._watcher.cancel()
        elif self._scope.get(ON_LOST) is not None:
            self._scope[ON_LOST] = None
