"""`dpd-router` with a window on its memory, for the memory benchmark's probes (`python -m benchmarks.memory`).

The router's own command line, run in a process that answers two signals, each writing a file into
`$DPD_BENCH_SNAPSHOTS` (n counting from 1 for each kind; the benchmark waits for the name):
- SIGUSR2: `<n>.alloc.json`, where the process's memory is: its resident pages by kind (/proc's smaps_rollup),
  glibc's heaps (mallinfo2: in use, free) and Python's allocator (its arenas and what their pools hold, from
  `sys._debugmallocstats`). Cheap: the run whose sizes are reported takes these.
- SIGUSR1, with `DPD_BENCH_TRACE_FRAMES` above 0 (every allocation traced from the start, that many frames
  deep): `<n>.snap`, a tracemalloc snapshot of what is still allocated after a collection, so the benchmark can
  say which lines of code hold what a probe left. Tracing slows the router several times over.
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import signal
import sys
import tempfile
import tracemalloc
from pathlib import Path
from types import FrameType
from typing import Any

from dpd_router.startup.allocator import Mallinfo2


def _write(path: Path, data: bytes) -> None:
    part = path.with_suffix(".part")
    part.write_bytes(data)
    part.rename(path)  # whole, or not there


def _pymalloc() -> dict[str, int]:
    """sys._debugmallocstats's totals; it writes to the C stderr, so that is pointed at a file meanwhile."""
    with tempfile.TemporaryFile() as out:
        sys.stderr.flush()
        saved = os.dup(2)
        try:
            os.dup2(out.fileno(), 2)
            sys._debugmallocstats()  # type: ignore[attr-defined]
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        out.seek(0)
        text = out.read().decode(errors="replace")
    wanted = {
        "arenas allocated current": "arenas_now",
        "arenas reclaimed": "arenas_reclaimed",
        "arenas highwater mark": "arenas_highwater",
        "bytes in allocated blocks": "bytes_in_blocks",
        "bytes in available blocks": "bytes_free_in_pools",
    }
    found: dict[str, int] = {}
    for line in text.splitlines():
        head, _, value = line.partition("=")
        key, value = head.strip().lstrip("#").strip(), value.strip().replace(",", "")
        if key in wanted and value.isdigit():
            found[wanted[key]] = int(value)
        elif "unused pools *" in key and value.isdigit():
            found["bytes_in_unused_pools"] = int(value)
    return found


def _glibc() -> dict[str, int]:
    try:
        info_of = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError):
        return {}
    info_of.argtypes, info_of.restype = [], Mallinfo2
    info = info_of()
    return {
        "heaps": info.arena,
        "heaps_in_use": info.uordblks,
        "heaps_free": info.fordblks + info.fsmblks,
        "mmapped": info.hblkhd,
    }


def _resident() -> dict[str, int]:
    kinds: dict[str, int] = {}
    try:
        for line in Path("/proc/self/smaps_rollup").read_text().splitlines()[1:]:
            name, _, value = line.partition(":")
            if value.strip().endswith("kB"):
                kinds[name.strip()] = int(value.split()[0]) * 1024
    except OSError:
        pass
    wanted = ("Rss", "Anonymous", "Shared_Clean", "Private_Clean", "Private_Dirty")
    return {key: kinds[key] for key in wanted if key in kinds}


def main() -> int:
    folder = Path(os.environ["DPD_BENCH_SNAPSHOTS"])
    frames = int(os.environ.get("DPD_BENCH_TRACE_FRAMES", "0"))
    if frames > 0:
        tracemalloc.start(frames)
    taken = {"snap": 0, "alloc": 0}

    def snapshot(_signum: int, _frame: FrameType | None) -> None:
        if not tracemalloc.is_tracing():
            return
        taken["snap"] += 1
        gc.collect()
        path = folder / f"{taken['snap']}.snap"
        tracemalloc.take_snapshot().dump(str(path.with_suffix(".part")))
        path.with_suffix(".part").rename(path)

    def allocators(_signum: int, _frame: FrameType | None) -> None:
        taken["alloc"] += 1
        where: dict[str, Any] = {"resident": _resident(), "glibc": _glibc(), "pymalloc": _pymalloc()}
        _write(folder / f"{taken['alloc']}.alloc.json", json.dumps(where).encode())

    signal.signal(signal.SIGUSR1, snapshot)
    signal.signal(signal.SIGUSR2, allocators)
    from dpd_router.cli import main as router

    return router(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
