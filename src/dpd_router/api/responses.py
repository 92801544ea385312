"""The gateway's answers as HTTP responses: built here, at the edge, and nowhere else."""

from __future__ import annotations

from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from dpd_router.gateway.answer import Answer, StreamedAnswer


class AnswerStream(StreamingResponse):
    """A streamed answer that ends its request once sent, also when the client left before its body
    began (`discard` ends one that is never sent at all)."""

    def __init__(self, answer: StreamedAnswer) -> None:
        super().__init__(answer.events, media_type=answer.media_type, headers=dict(answer.headers))
        self._answer = answer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._answer.close()


def http_response(answer: Answer) -> Response:
    if isinstance(answer, StreamedAnswer):
        return AnswerStream(answer)
    return Response(
        answer.content, status_code=answer.status, media_type=answer.media_type, headers=dict(answer.headers)
    )


async def discard(answer: Answer) -> None:
    """End an answer that will never be sent: a stream's upstream, and the request's record and
    admission slot (a whole answer released them when it was read)."""
    if isinstance(answer, StreamedAnswer):
        await answer.close()
