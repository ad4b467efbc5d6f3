"""Progress of long work (pack, verify, bench, synth): one helper for all of them.

On a terminal it draws a tqdm bar on stderr. Elsewhere (a batch job, a CI log, a file) a bar would
be noise or invisible, so it logs a line on the ``stoker.progress`` logger every ``interval``
seconds instead, plus one at the end; the CLI sends those lines to stderr, a library user sees them
through their own logging setup. ``enabled=False`` (the CLI's ``--quiet``) shows nothing.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any, TextIO

LOGGER_NAME = "stoker.progress"
LOG_INTERVAL_S = 5.0   # seconds between log lines when not on a terminal

log = logging.getLogger(LOGGER_NAME)


def _is_terminal(stream: TextIO | None) -> bool:
    try:
        return stream is not None and stream.isatty()
    except (AttributeError, ValueError):  # replaced or closed stream
        return False


class Progress:
    """Counts `unit`s done out of `total` (None: unknown) for the task `desc`."""

    def __init__(self, desc: str, total: int | None, *, unit: str = "img", initial: int = 0,
                 enabled: bool = True, interval: float = LOG_INTERVAL_S, terminal: bool | None = None) -> None:
        self.desc, self.total, self.unit, self.interval = desc, total, unit, interval
        self.done = initial
        self._initial = initial
        self._postfix: dict[str, Any] = {}
        self._started = self._last_log = time.monotonic()
        self._closed = not enabled
        self._bar: Any = None
        if enabled and (_is_terminal(sys.stderr) if terminal is None else terminal):
            from tqdm.auto import tqdm
            self._bar = tqdm(total=total, initial=initial, unit=unit, desc=desc, dynamic_ncols=True)

    def update(self, n: int = 1) -> None:
        self.done += n
        if self._closed:
            return
        if self._bar is not None:
            self._bar.update(n)
            return
        now = time.monotonic()
        if now - self._last_log >= self.interval:
            self._last_log = now
            self._log(now)

    def stage(self, text: str) -> None:
        """A new step of the work starts (`measuring baseline`): logged at once, shown on the bar."""
        if self._closed:
            return
        if self._bar is not None:
            self._bar.set_description_str(f"{self.desc}: {text}")
        else:
            log.info("%s: %s (%s)", self.desc, text, self.line().split(": ", 1)[1])

    def set_postfix(self, **values: Any) -> None:
        """Extra figures for the bar and the log line, e.g. skipped=3."""
        self._postfix.update(values)
        if self._bar is not None and not self._closed:
            self._bar.set_postfix(self._postfix, refresh=False)

    def line(self, now: float | None = None) -> str:
        """The log line: `pack: 1,200/5,000 img (24%), 310 img/s, skipped=2`."""
        elapsed = (time.monotonic() if now is None else now) - self._started
        count = f"{self.done:,}" if self.total is None else f"{self.done:,}/{self.total:,}"
        parts = [f"{self.desc}: {count} {self.unit}"]
        if self.total:
            parts[0] += f" ({100 * self.done / self.total:.0f}%)"
        done = self.done - self._initial
        if elapsed > 0 and done / elapsed >= 1:
            parts.append(f"{done / elapsed:,.0f} {self.unit}/s")
        elif done > 0:   # slow units (a bench pipeline, a training step): "0 pipeline/s" says nothing
            parts.append(f"{elapsed / done:,.1f} s/{self.unit}")
        parts.extend(f"{k}={v}" for k, v in self._postfix.items())
        return ", ".join(parts)

    def _log(self, now: float) -> None:
        log.info("%s", self.line(now))

    def close(self) -> None:
        """End the bar, or log the final count. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._bar is not None:
            self._bar.close()
        else:
            self._log(time.monotonic())

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
