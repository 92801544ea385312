"""Where the test process's main thread stood still: the event loop it runs (the tests', the routers' and
the links' alike) served nothing meanwhile.

On a CI machine the real engines keep both cores busy, and a few milliseconds of the test process's own
work (a TLS context, a large JSON) can stretch to seconds: a call timing out in a test then says nothing of
why. A thread samples the main thread's innermost frame every 50 ms; a line it stays on for a second or more,
outside the event loop's wait for I/O, is kept with its stack and listed in the run's summary.
"""

from __future__ import annotations

import sys
import threading
import time
import traceback
from dataclasses import dataclass

# A pause this long or longer is reported.
REPORTED_SECONDS = 1.0
# Functions the loop waits in for I/O (selectors' and uvloop's): standing there is being idle.
_IDLE = frozenset({"select", "poll", "_run_once", "run_forever"})


@dataclass
class Stall:
    at: str  # wall-clock time it began
    seconds: float
    stack: str  # the innermost frames


class StallWatch:
    def __init__(self, interval: float = 0.05) -> None:
        self._interval = interval
        self._main = threading.main_thread().ident
        self.stalls: list[Stall] = []
        threading.Thread(target=self._run, name="stall-watch", daemon=True).start()

    def _run(self) -> None:
        last: tuple[int, int] | None = None
        since = time.monotonic()
        stack = ""
        while True:
            time.sleep(self._interval)
            frame = sys._current_frames().get(self._main or 0)
            if frame is None:
                return
            now = time.monotonic()
            here = (id(frame.f_code), frame.f_lineno)
            if here == last:
                if not stack and now - since >= REPORTED_SECONDS and frame.f_code.co_name not in _IDLE:
                    stack = "".join(traceback.format_stack(frame)[-4:])
                continue
            if stack:
                began = time.strftime("%H:%M:%S", time.localtime(time.time() - (now - since)))
                self.stalls.append(Stall(began, now - since, stack))
            last, since, stack = here, now, ""

    def report(self) -> list[str]:
        """The ten longest holds with their stacks, the longest last, then a line listing them all: a CI log
        shows a run's last lines."""
        longest = sorted(self.stalls, key=lambda stall: stall.seconds)[-10:]
        lines = [f"{stall.at}: {stall.seconds:.1f} s on\n{stall.stack}" for stall in longest]
        if self.stalls:
            held = sorted(self.stalls, key=lambda stall: -stall.seconds)
            total = sum(stall.seconds for stall in held)
            lines.append(
                f"held {len(held)} times, {total:.0f} s in all; longest: "
                + ", ".join(f"{stall.seconds:.1f} s at {stall.at}" for stall in held[:8])
            )
        return lines
