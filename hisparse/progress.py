"""Progress lines on stderr for the commands whose runs take seconds to minutes (the Triton interpreter
on a CPU, a large checkpoint): `[  12.3 s] what`, the seconds since the command began."""
import sys
import time

PROGRESS_EVERY_S = 5.0          # the least time between two lines of a loop's steps


class Progress:
    """`progress(what)` prints a stage's line; `progress(what, every=5.0)` only where that many seconds
    have passed since the last line (a loop's steps: a few lines a minute, however fast the steps)."""

    def __init__(self, stream=None):
        self.start = self.last = time.perf_counter()
        self.stream = stream

    def __call__(self, what: str, every: float = 0.0) -> None:
        now = time.perf_counter()
        if now - self.last < every:
            return
        self.last = now
        print(f"[{now - self.start:7.1f} s] {what}", file=self.stream or sys.stderr, flush=True)
