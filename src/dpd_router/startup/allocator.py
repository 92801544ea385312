"""Memory the router frees goes back to the system: glibc's allocator told so at startup, and trimmed beside
the requests.

glibc serves a large block (a body of megabytes, the strings parsed from it, a prompt's encoding) with its
own mmap and unmaps it when it is freed, until the first such block is freed: then it raises its mmap
threshold to that block's size (up to 32 MiB), and every later block below it comes from a heap (the main
one, or the arena of the thread that asked: the body parser's, a tokenizer lane's), which keeps what is
freed: up to twice the threshold at each heap's top, and every hole below, so a round of large bodies leaves
the process larger by what they took, all of it free. Pinned at its default (128 KiB), the threshold keeps
large blocks in mmap. What small blocks leave free in the heaps (a burst of a thousand
streams) goes back by malloc_trim, from a thread, each time a step more of it is free than at the last trim
(`MemoryReturn`).
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("dpd_router.app")

MMAP_THRESHOLD = 128 * 1024  # glibc's own default, pinned: blocks of this size or more are mmapped
_M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)
TRIM_STEP = 4 * 1024 * 1024
TRIM_INTERVAL = 10.0


class Mallinfo2(ctypes.Structure):
    """glibc's struct mallinfo2 (malloc.h): arena is the heaps' size, uordblks what is in use, fordblks and
    fsmblks what is free, hblkhd what is mmapped."""

    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


@dataclass(frozen=True)
class Glibc:
    """The calls of glibc's allocator the router makes; `free_bytes` (mallinfo2, glibc 2.33+): what the heaps
    hold free, None where this glibc cannot tell."""

    mallopt: Callable[[int, int], int]
    malloc_trim: Callable[[int], int]
    free_bytes: Callable[[], int] | None = None

    @classmethod
    def find(cls) -> Glibc | None:
        """The process's glibc allocator; None where the C library is another (musl, macOS)."""
        try:
            libc = ctypes.CDLL(None)  # the C library the interpreter runs on
            mallopt, malloc_trim = libc.mallopt, libc.malloc_trim
        except (OSError, AttributeError):
            return None
        mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
        malloc_trim.argtypes, malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
        mallinfo2 = getattr(libc, "mallinfo2", None)
        if mallinfo2 is None:
            return cls(mallopt=mallopt, malloc_trim=malloc_trim)
        mallinfo2.argtypes, mallinfo2.restype = [], Mallinfo2

        def free_bytes() -> int:
            info = mallinfo2()
            return int(info.fordblks + info.fsmblks)

        return cls(mallopt=mallopt, malloc_trim=malloc_trim, free_bytes=free_bytes)


def threshold_chosen(environ: Mapping[str, str]) -> bool:
    """Whether the operator set glibc's mmap threshold (MALLOC_MMAP_THRESHOLD_ or GLIBC_TUNABLES): theirs stands."""
    return "MALLOC_MMAP_THRESHOLD_" in environ or "glibc.malloc.mmap_threshold" in environ.get("GLIBC_TUNABLES", "")


def pin_mmap_threshold(glibc: Glibc | None, environ: Mapping[str, str] = os.environ) -> bool:
    """Keep large blocks in mmap for the process's life (module docstring); whether it was pinned here."""
    if glibc is None or threshold_chosen(environ):
        return False
    return glibc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1


def resident_bytes() -> int | None:
    """The process's resident set size, from /proc (None where there is none)."""
    try:
        with Path("/proc/self/statm").open() as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


class MemoryReturn:
    """Pins glibc's mmap threshold (unless the operator set it), then gives the heaps' free memory back to
    the system (malloc_trim, in a thread) whenever a `step` more of it is free than the least there was since
    the last trim; where glibc cannot say what is free, whenever the process has grown by a step over the
    least it held since the last trim.

    A trim leaves the chunks it emptied free (only their pages go back), so what is free after it is the
    next mark: memory freed and trimmed is not trimmed again until a step more is freed. The trim itself
    holds each heap (an allocation in it waits) for as long as handing back its free pages takes, hence a
    step between trims rather than one every round.
    """

    def __init__(
        self,
        glibc: Glibc,
        *,
        resident: Callable[[], int | None] = resident_bytes,
        step: int = TRIM_STEP,
        interval: float = TRIM_INTERVAL,
    ) -> None:
        self._glibc = glibc
        self._measure: Callable[[], int | None] = glibc.free_bytes or resident
        self._resident = resident
        self._step = step
        self._interval = interval
        self._low = self._measure() or 0
        self.trims = 0

    async def trim_if_grown(self) -> bool:
        """Trim now if a step more is free (or the process has grown by a step); whether it did."""
        size = self._measure()
        if size is None:
            return False
        if size < self._low + self._step:
            self._low = min(self._low, size)
            return False
        by_rss = self._glibc.free_bytes is None
        before = size if by_rss else self._resident()
        await asyncio.to_thread(self._glibc.malloc_trim, 0)
        self.trims += 1
        after = self._resident()
        if before is not None and after is not None:
            log.debug("gave %d MiB of freed memory back to the system", (before - after) >> 20)
        self._low = (after if by_rss else self._measure()) or size
        return True

    @classmethod
    def for_this_process(cls) -> MemoryReturn | None:
        """None where the allocator is not glibc's."""
        glibc = Glibc.find()
        return None if glibc is None else cls(glibc)

    async def run(self) -> None:
        pin_mmap_threshold(self._glibc)
        while True:
            await asyncio.sleep(self._interval)
            await self.trim_if_grown()
