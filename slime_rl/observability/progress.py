"""Progress while a run is busy: a bar during rollout and eval, `step k/N`, elapsed time and an ETA
on the driver's line per step.

`Progress` is tqdm's bar on a terminal. Anywhere else (a log file, a pipe, a Ray actor, whose output
the driver forwards line by line, so a bar's carriage returns would show nothing until the end) it
prints a plain line every `interval_s` seconds, and a closing line if it printed any: a short
rollout prints nothing, a long one shows it is alive.
"""

from __future__ import annotations

import collections
import sys
import time
from collections.abc import Callable
from typing import TextIO

from tqdm import tqdm

# seconds between two progress lines where the output is not a terminal
PROGRESS_INTERVAL_S = 10.0


def format_duration(seconds: float) -> str:
    """4.2 -> '4.2s', 75 -> '1m15s', 3725 -> '1h02m'."""
    if seconds < 60:
        return f"{seconds:.1f}s"
    s = int(round(seconds))
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


class Progress:
    """`done` of `total` units; `update(n)` adds, `note(text)` sets a trailing remark. A bar on a TTY,
    lines every `interval_s` otherwise (see the module docstring); `enabled=False`: silent."""

    def __init__(self, total: int, desc: str, unit: str = "sample", *, enabled: bool = True,
                 stream: TextIO | None = None, interval_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.total, self.desc, self.unit = total, desc, unit
        self.done = 0
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.interval_s = PROGRESS_INTERVAL_S if interval_s is None else interval_s
        self.clock = clock
        self.start = clock()
        self._last_line = self.start
        self._printed = False
        self._note = ""
        tty = enabled and bool(getattr(self.stream, "isatty", lambda: False)())
        self._bar = tqdm(total=total, desc=desc, unit=unit, file=self.stream, leave=False, mininterval=0.5,
                         dynamic_ncols=True) if tty else None

    def update(self, n: int = 1) -> None:
        self.done += n
        if self._bar is not None:
            self._bar.update(n)
        elif self.enabled and self.clock() - self._last_line >= self.interval_s:
            self._line()

    def add_total(self, n: int) -> None:
        """More units to do than planned (e.g. a group a filter dropped must be replaced)."""
        self.total += n
        if self._bar is not None:
            self._bar.total = self.total
            self._bar.refresh()

    def note(self, text: str) -> None:
        self._note = text
        if self._bar is not None:
            self._bar.set_postfix_str(text, refresh=False)

    def line(self) -> str:
        """What a progress line says: done/total, the share, elapsed and the ETA at the mean rate so far."""
        elapsed = self.clock() - self.start
        pct = 100.0 * self.done / self.total if self.total else 100.0
        eta = (f"ETA {format_duration(elapsed / self.done * (self.total - self.done))}"
               if 0 < self.done < self.total else "ETA -")
        note = f" | {self._note}" if self._note else ""
        return (f"{self.desc}: {self.done}/{self.total} {self.unit}s ({pct:.0f}%) | "
                f"{format_duration(elapsed)} elapsed, {eta}{note}")

    def _line(self) -> None:
        print(self.line(), file=self.stream, flush=True)
        self._last_line = self.clock()
        self._printed = True

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        elif self.enabled and self._printed:  # it was long enough to report: say that it ended
            self._line()
            self._printed = False

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class StepClock:
    """Time since the run started (made) and the ETA of its remaining steps from the mean of the
    last `window` step times (recent steps predict the next ones better than the first, slower ones)."""

    def __init__(self, total_steps: int, window: int = 10, clock: Callable[[], float] = time.monotonic) -> None:
        self.total = total_steps
        self.clock = clock
        self.start = clock()
        self.recent: collections.deque[float] = collections.deque(maxlen=window)

    def step_done(self, step: int, step_s: float) -> dict[str, float]:
        """Record that `step` (0-based) took `step_s`; returns {"elapsed_s", "eta_s"}."""
        self.recent.append(step_s)
        left = max(self.total - (step + 1), 0)
        return {"elapsed_s": self.clock() - self.start, "eta_s": sum(self.recent) / len(self.recent) * left}
