"""Freed memory goes back to the system: glibc's mmap threshold pinned unless the operator chose one, and the
heaps trimmed once a step of growth, not on every round."""

from __future__ import annotations

import ctypes.util
import platform
from collections.abc import Iterator

import pytest

from dpd_router.startup.allocator import MMAP_THRESHOLD, Glibc, MemoryReturn, pin_mmap_threshold, resident_bytes

MiB = 1 << 20


class FakeGlibc:
    """Records the allocator calls instead of making them."""

    def __init__(self) -> None:
        self.options: list[tuple[int, int]] = []
        self.trims: list[int] = []

    def mallopt(self, param: int, value: int) -> int:
        self.options.append((param, value))
        return 1

    def malloc_trim(self, pad: int) -> int:
        self.trims.append(pad)
        return 1

    def as_glibc(self) -> Glibc:
        return Glibc(mallopt=self.mallopt, malloc_trim=self.malloc_trim)


def sizes(*values: int) -> Iterator[int]:
    yield from values


def memory_return(fake: FakeGlibc, *resident: int) -> MemoryReturn:
    """A MemoryReturn whose readings of the process's size are `resident`, in order (the first at its start)."""
    readings = sizes(*resident)
    return MemoryReturn(fake.as_glibc(), resident=lambda: next(readings), step=16 * MiB)


def test_the_threshold_is_pinned_at_glibcs_default() -> None:
    fake = FakeGlibc()

    assert pin_mmap_threshold(fake.as_glibc(), {})
    assert fake.options == [(-3, MMAP_THRESHOLD)]  # M_MMAP_THRESHOLD: no more raising it after a large free


@pytest.mark.parametrize(
    "environ",
    [
        {"MALLOC_MMAP_THRESHOLD_": "1048576"},
        {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2:glibc.malloc.mmap_threshold=65536"},
    ],
)
def test_an_operators_threshold_is_left_as_set(environ: dict[str, str]) -> None:
    fake = FakeGlibc()

    assert not pin_mmap_threshold(fake.as_glibc(), environ)
    assert fake.options == []


def test_no_threshold_is_pinned_without_glibc() -> None:
    assert not pin_mmap_threshold(None, {})


async def test_growth_below_a_step_is_not_trimmed() -> None:
    fake = FakeGlibc()
    memory = memory_return(fake, 100 * MiB, 110 * MiB, 115 * MiB)

    assert not await memory.trim_if_grown()
    assert not await memory.trim_if_grown()
    assert fake.trims == []


async def test_a_step_of_growth_is_trimmed_once_and_the_size_after_is_the_new_mark() -> None:
    fake = FakeGlibc()
    # Start at 100; grown to 130: trim (130 read before, 104 after); 115 is under a step above 104.
    memory = memory_return(fake, 100 * MiB, 130 * MiB, 104 * MiB, 115 * MiB)

    assert await memory.trim_if_grown()
    assert not await memory.trim_if_grown()
    assert fake.trims == [0]
    assert memory.trims == 1


async def test_the_mark_follows_the_size_down() -> None:
    fake = FakeGlibc()
    # The process gave memory back by itself (100 -> 80): growth is counted from 80.
    memory = memory_return(fake, 100 * MiB, 80 * MiB, 97 * MiB, 90 * MiB)

    assert not await memory.trim_if_grown()
    assert await memory.trim_if_grown()


async def test_nothing_is_trimmed_when_the_size_cannot_be_read() -> None:
    fake = FakeGlibc()
    memory = MemoryReturn(fake.as_glibc(), resident=lambda: None, step=16 * MiB)

    assert not await memory.trim_if_grown()
    assert fake.trims == []


@pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc" or ctypes.util.find_library("c") is None,
    reason="glibc's allocator only",
)
def test_this_processs_glibc_is_found_and_trims() -> None:
    glibc = Glibc.find()

    assert glibc is not None
    assert glibc.malloc_trim(0) in (0, 1)
    assert (resident_bytes() or 0) > 0


async def test_where_glibc_says_what_is_free_a_step_more_free_is_trimmed_and_what_stays_free_is_the_mark() -> None:
    fake = FakeGlibc()
    free = sizes(0, 10 * MiB, 20 * MiB, 20 * MiB, 30 * MiB, 5 * MiB, 22 * MiB, 22 * MiB)
    glibc = Glibc(mallopt=fake.mallopt, malloc_trim=fake.malloc_trim, free_bytes=lambda: next(free))
    # The process's size is not what decides: it never moves here.
    memory = MemoryReturn(glibc, resident=lambda: 200 * MiB, step=16 * MiB)

    assert not await memory.trim_if_grown()  # 10 free: under a step
    assert await memory.trim_if_grown()  # 20 free: trimmed; 20 stay free (pages gone, chunks kept)
    assert not await memory.trim_if_grown()  # 30: under a step above what the trim left
    assert not await memory.trim_if_grown()  # 5: reused, the mark follows it down
    assert await memory.trim_if_grown()  # 22: a step above 5
    assert fake.trims == [0, 0]
