"""The router's log writer (record/logs.py): no line lost to a writer that was closed under it, and no memory
lost to a stderr that does not keep up."""

from __future__ import annotations

import io
import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from dpd_router.record.logs import JsonFormatter, LineWriter


@contextmanager
def logging_to(writer: LineWriter) -> Iterator[logging.Logger]:
    writer.setFormatter(JsonFormatter())
    logger = logging.getLogger("dpd_router.test_logs")
    logger.handlers[:] = [writer]
    logger.propagate = False
    logger.setLevel(logging.INFO)
    try:
        yield logger
    finally:
        writer.close()
        logger.handlers[:] = []


def messages(text: str) -> list[str]:
    return [line.split('"msg":"')[1].split('"')[0] for line in text.splitlines()]


def test_log_lines_are_written_in_order_a_warning_at_once_and_the_rest_on_close() -> None:
    stream = io.StringIO()
    writer = LineWriter(stream, interval=60)  # no timed write within the test
    with logging_to(writer) as logger:
        logger.info("first")
        logger.info("second")
        assert stream.getvalue() == "", "an info line waits for the writer"
        logger.warning("third")
        for _ in range(500):
            if "third" in stream.getvalue():
                break
            time.sleep(0.01)
        assert messages(stream.getvalue()) == ["first", "second", "third"]
        logger.info("fourth")
    assert messages(stream.getvalue())[-1] == "fourth", "closing writes what is left"


def test_a_writer_closed_while_its_logger_keeps_it_writes_each_line_as_it_is_logged() -> None:
    """logging.config (as uvicorn's default configuration applies it) closes every handler it finds, while
    the loggers it does not configure keep theirs: the lines logged after that are written, not kept."""
    stream = io.StringIO()
    writer = LineWriter(stream, interval=60)
    with logging_to(writer) as logger:
        logger.info("before")
        logging.shutdown([lambda: writer])  # what logging.config's clearing of existing handlers does
        assert messages(stream.getvalue()) == ["before"], "closing writes what waited"
        for number in range(3):
            logger.info("after %d", number)
        assert messages(stream.getvalue()) == ["before", "after 0", "after 1", "after 2"]
        assert writer._lines == []


class StalledStream(io.StringIO):
    """A stderr whose writes wait until it is let go (a log pipe nobody reads)."""

    def __init__(self) -> None:
        super().__init__()
        self.go = threading.Event()
        self.writing = threading.Event()

    def write(self, text: str) -> int:
        self.writing.set()
        self.go.wait(30)
        return super().write(text)


def test_lines_past_the_bound_wait_for_no_writer_and_are_counted_once_it_is_through() -> None:
    stream = StalledStream()
    writer = LineWriter(stream, interval=0.01, pending=5)
    with logging_to(writer) as logger:
        logger.warning("stalls the writer")  # a warning wakes the writer, whose write then waits
        assert stream.writing.wait(10)
        for number in range(12):
            logger.info("line %d", number)
        assert len(writer._lines) == 5, "at most `pending` lines wait"
        stream.go.set()
        for _ in range(500):
            if "dropped" in stream.getvalue():
                break
            time.sleep(0.01)
        written = messages(stream.getvalue())
    assert written[:6] == ["stalls the writer", *(f"line {number}" for number in range(5))]
    assert written[6] == "7 log lines dropped: stderr did not keep up (5 lines may wait)"
    assert '"level":"warning"' in stream.getvalue().splitlines()[6]
