"""Progress display: a live bar on a terminal, one line per evaluation otherwise, nothing if quiet."""

from __future__ import annotations

import sys
import threading
import time
from contextlib import contextmanager
from typing import Iterator


def duration(seconds: float) -> str:
    """``75`` -> ``1m15s``, ``3700`` -> ``1h01m``: an elapsed time or ETA in a progress line."""
    seconds = int(seconds)
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"


#: seconds between two lines of a stage's progress where there is no terminal bar (a log)
STAGE_EVERY = 60.0


class Progress:
    def __init__(self, total_rounds: int, start_round: int, label: str, quiet: bool):
        self.total, self.start, self.label, self.quiet = total_rounds, start_round, label, quiet
        self.t0 = time.perf_counter()
        self.latest = ""
        self.live = None
        #: the stage :meth:`waiting` is in (what, when its progress was last printed)
        self._stage: tuple[str, float] | None = None
        #: the count under way in it (unit, total, done, when the count began, when its last step came)
        self._count: tuple[str, int, int, float, float] = ("", 0, 0, 0.0, 0.0)
        if not quiet and sys.stderr.isatty():
            from rich.progress import BarColumn, MofNCompleteColumn, Progress as Bar, TextColumn, TimeRemainingColumn

            self.live = Bar(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                            TextColumn("ETA"), TimeRemainingColumn(), TextColumn("{task.fields[latest]}"),
                            transient=False)
            self.task = self.live.add_task(label, total=total_rounds, completed=start_round, latest="")
            self.live.start()

    def update(self, rnd: int, metrics: dict | None) -> None:
        if metrics:
            parts = [f"{k} {metrics[k]:.2f}" for k in ("acc", "few_acc", "pm_acc") if metrics.get(k) is not None]
            self.latest = " | ".join(parts)
        if self.live is not None:
            self.live.update(self.task, completed=rnd, latest=self.latest)
        elif not self.quiet and (metrics or rnd == self.total):
            done = rnd - self.start
            elapsed = time.perf_counter() - self.t0
            eta = elapsed / max(done, 1) * (self.total - rnd)
            parts = [f"round {rnd}/{self.total}", self.latest, f"{elapsed / max(done, 1):.2f} s/round",
                     f"ETA {duration(eta)}"]
            print(f"[{self.label}] " + " | ".join(p for p in parts if p), file=sys.stderr, flush=True)

    @contextmanager
    def waiting(self, what: str, after: float = 5.0, restart_clock: bool = True) -> Iterator[None]:
        """Say ``what`` is going on if it takes longer than ``after`` seconds (a method's setup stage can
        take a minute before round 1: FedLoGe's SSE-C; its final stage too: SAFS); quick work prints
        nothing. With ``restart_clock``, work that is not a round: the rounds' s/round and ETA start after it."""
        timer = None
        now = time.perf_counter()
        self._stage = (what, now + after)  # its first progress line: STAGE_EVERY after its notice
        self._count = ("", 0, 0, now, now)
        if self.live is not None:  # a terminal's bar names it at once, in place
            self.live.update(self.task, latest=what)
        elif not self.quiet:
            timer = threading.Timer(after, self._say, (f"[{self.label}] {what} ...\n",))
            timer.daemon = True
            timer.start()
        try:
            yield
        finally:
            self._stage = None
            if timer is not None:
                timer.cancel()
            if self.live is not None:
                self.live.update(self.task, latest=self.latest)
            if restart_clock:
                self.t0 = time.perf_counter()

    def stage_step(self, done: int, total: int, unit: str) -> None:
        """A long stage (see :meth:`waiting`) has done ``done`` of ``total`` ``unit``: the bar shows it at
        once, a log a line every :data:`STAGE_EVERY` seconds, each with the ETA of that count (a stage may
        count several things in turn: the clients' answers, then SAFS's classes)."""
        if self._stage is None or self.quiet or done <= 0:
            return
        what, said = self._stage
        now = time.perf_counter()
        counting, of, before, began, last = self._count
        if (unit, total) != (counting, of) or done < before:  # another count (SAFS's classes after the clients'
            began = last                                      # answers): its ETA from where the last one ended
        self._count = (unit, total, done, began, now)
        text = f"{what}: {done}/{total} {unit}, ETA {duration((now - began) / done * (total - done))}"
        if self.live is not None:
            self.live.update(self.task, latest=text)
        elif now - said >= STAGE_EVERY:
            self._stage = (what, now)
            self._say(f"[{self.label}] {text}\n")

    @staticmethod
    def _say(line: str) -> None:
        sys.stderr.write(line)  # one write: a line of another thread cannot land inside it
        sys.stderr.flush()

    def close(self) -> None:
        if self.live is not None:
            self.live.stop()
