"""Stopping on a signal: SIGTERM/SIGINT become a flag the loop checks at batch boundaries, and
the error a stopped run ends with."""
from __future__ import annotations

import signal
from pathlib import Path


class TrainingInterrupted(RuntimeError):
    """SIGTERM/SIGINT: the progress saved (a checkpoint; None before the first optimizer step) and
    the target stopped."""

    def __init__(self, signum: int, checkpoint: Path | None):
        super().__init__(f"stopped by {signal.Signals(signum).name}; checkpoint: "
                         f"{checkpoint or 'none (no optimizer step yet: a fresh start is the same)'}")
        self.signum, self.checkpoint = signum, checkpoint


class StopOnSignal:
    """Turns the first SIGTERM/SIGINT into a flag checked at safe points; a second one acts as usual."""

    def __init__(self):
        self.signum: int | None = None
        self._previous = {}

    def __enter__(self):
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        self.signum = signum
        signal.signal(signum, self._previous.get(signum, signal.SIG_DFL))

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def requested(self) -> bool:
        return self.signum is not None
