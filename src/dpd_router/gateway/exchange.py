"""One client request on its way through the gateway: what every stage after planning needs."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from dpd_router.gateway.answer import Answer
from dpd_router.gateway.completion import Completion
from dpd_router.gateway.deadlines import HopDeadlines
from dpd_router.gateway.judge import FailureJudge
from dpd_router.gateway.policy import PhaseTimeouts, RetryPolicy
from dpd_router.gateway.resume import ResumePolicy
from dpd_router.pool.endpoint import Endpoint, Slot
from dpd_router.prompt.tokenizer import Prompt
from dpd_router.record.observe import Asked, Ending, Output, Staging
from dpd_router.request.client_request import ClientRequest
from dpd_router.routing.planner import Planner


class FirstToken:
    """The request's first output token as its client gets it (a decoder's, or a head the router sent
    itself), and what waits for it: a streamed direct call's prompt counts in its decoder's prefill queue
    until then (`hold`), or until the request ends without one."""

    def __init__(self) -> None:
        self.reached = False
        self._slot: Slot | None = None

    def hold(self, slot: Slot) -> None:
        """Hold `slot` until the first token, or the request's end before one; what was held before (an
        earlier decoder's queue: it failed before its first token) is released now."""
        earlier, self._slot = self._slot, slot
        if earlier is not None:
            earlier.release()

    def reach(self) -> None:
        if not self.reached:
            self.reached = True
            self.release()

    def release(self) -> None:
        slot, self._slot = self._slot, None
        if slot is not None:
            slot.release()


@dataclass(frozen=True)
class Exchange:
    """A request being served, with the policies it started under (a live change applies to the next)."""

    request: ClientRequest
    prompt: Prompt
    # The prompt tokens its plan found no engine to hold (the planner's estimate): what its hops are sized by.
    uncached_tokens: int
    planner: Planner
    request_id: str
    # Who asked (its model and arm label the hops' metrics; a continuation starts from it).
    asked: Asked
    done: Completion
    # The router asked the stream for a usage chunk the client did not: drop it before the client.
    strip_usage: bool
    # What this pool's hops have been taking: the learned deadlines of this request's hops.
    deadlines: HopDeadlines
    timeouts: PhaseTimeouts
    retries: RetryPolicy
    prefill_judge: FailureJudge = field(default_factory=FailureJudge)
    decode_judge: FailureJudge = field(default_factory=FailureJudge)
    # Whether and how a stream whose decoder fails after output is continued (None: not a stream), and what
    # serves the continuation (the gateway's).
    resume: ResumePolicy | None = None
    continue_with: ContinueWith | None = None
    first_token: FirstToken = field(default_factory=FirstToken)

    def __post_init__(self) -> None:
        # The request's judges look at its hops only while it is served: they close when it ends.
        self.done.defer(self.prefill_judge.close)
        self.done.defer(self.decode_judge.close)
        self.done.defer(self.first_token.release)

    @property
    def output(self) -> Output:
        """What the decoders produced for the client (the request's record takes it at its end)."""
        return self.done.output

    @property
    def staging(self) -> Staging:
        """What the prefill hop produced (the request's record takes it at its end)."""
        return self.done.staging

    @property
    def ending(self) -> Ending:
        """How the request ended (the request's record takes it at its end)."""
        return self.done.ending

    @property
    def headers(self) -> dict[str, str]:
        """The headers of the router's answer."""
        return {"X-Request-Id": self.request_id}


# Serves the continuation of an exchange's stream (a text completion of ids, or a chat call that continues the
# text said) away from the failed decoder, with so many continuations left: its answer, and where it is served.
ContinueWith = Callable[["Exchange", ClientRequest, Endpoint | None, int], Awaitable[tuple[Answer, str]]]


def ask_for_usage(request: ClientRequest) -> bool:
    """Make a stream end with a usage chunk, which the metrics need (output and cached tokens).

    Returns True when the client did not ask for it: the relay then drops it before the client sees it.
    """
    if not request.stream or request.kind in ("messages", "responses"):  # their streams' last events carry it
        return False
    options = request.body.get("stream_options")
    if isinstance(options, dict) and options.get("include_usage"):
        return False
    request.body["stream_options"] = {**(options if isinstance(options, dict) else {}), "include_usage": True}
    request.body_changed = True
    return True
