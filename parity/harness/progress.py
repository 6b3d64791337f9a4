"""Where a long parity run is: its stage (reference build, engine start, capture, compare, diagnose, write)
and its step within the stage, said on pytest's terminal while the first parity item waits for them.

:class:`Progress` says nothing (a run outside pytest, or under ``-q``); :func:`for_pytest` gives the one
that writes through pytest's terminal reporter. On a terminal each step rewrites one line; in a log
(no terminal) a step is written at most every ``every`` seconds, and the last step of each stage always.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable


class Progress:
    """A run's progress, said nowhere."""

    def stage(self, name: str, detail: str = "") -> None:
        """A stage begins."""

    def step(self, i: int, n: int, what: str = "") -> None:
        """Step ``i`` of ``n`` of the current stage is done."""

    def done(self) -> None:
        """The run ends: leave the terminal on a fresh line."""

    def steps(self, n: int, what: str = "") -> Callable[..., None]:
        """A callback that counts its calls as this stage's steps, of ``n`` (for a forward hook)."""
        count = [0]

        def tick(*_: Any) -> None:
            count[0] += 1
            self.step(count[0], n, what)
        return tick

    @contextlib.contextmanager
    def layers(self, modules, forwards: int):
        """Each decoder layer's forward in ``modules``, over ``forwards`` forward passes, as a step."""
        tick = self.steps(len(modules) * forwards, "layer forwards")
        handles = [m.register_forward_hook(tick) for m in modules]
        try:
            yield
        finally:
            for h in handles:
                h.remove()


class TerminalProgress(Progress):
    """Progress through pytest's terminal reporter, past output capturing (the items run captured)."""

    def __init__(self, reporter, capture=None, tty: bool = False, every: float = 5.0,
                 clock: Callable[[], float] = time.monotonic):
        self.reporter, self.capture, self.tty, self.every, self.clock = reporter, capture, tty, every, clock
        self.name, self.started, self.last, self.open = "", 0.0, 0.0, False

    @contextlib.contextmanager
    def _uncaptured(self):
        if self.capture is None:
            yield
        else:
            with self.capture.global_and_fixture_disabled():
                yield

    def stage(self, name: str, detail: str = "") -> None:
        with self._uncaptured():
            self._end_line()
            self.name, self.started = name, self.clock()
            self.last = self.started
            self.reporter.write_line(f"parity: {name}" + (f" ({detail})" if detail else ""), cyan=True)

    def step(self, i: int, n: int, what: str = "") -> None:
        now = self.clock()
        last = i >= n
        if not self.tty and not last and now - self.last < self.every:
            return
        text = f"parity: {self.name} {i}/{n}" + (f" {what}" if what else "")
        if last:
            text += f" ({now - self.started:.1f} s)"
        with self._uncaptured():
            if self.tty:
                self.reporter.rewrite(text, erase=True)
                self.open = True
                if last:
                    self._end_line()
            else:
                self.reporter.write_line(text)
        self.last = now

    def done(self) -> None:
        with self._uncaptured():
            self._end_line()

    def _end_line(self) -> None:
        if self.open:
            self.reporter.write("\n")
            self.open = False


def for_pytest(config) -> Progress:
    """The progress of a pytest session: quiet under ``-q`` and without a terminal reporter."""
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None or config.option.verbose < 0:
        return Progress()
    return TerminalProgress(reporter, config.pluginmanager.get_plugin("capturemanager"), tty=bool(reporter.isatty))
