"""The progress bar a command shows on a terminal: a writer's ``progress(bytes_done, bytes_total)``."""
from __future__ import annotations

import sys
from typing import TextIO


def is_tty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


class ProgressBar:
    """A tqdm bar of bytes written, created on the first report (when the total is known)."""

    def __init__(self, enabled: bool, desc: str):
        self.enabled = enabled
        self.desc = desc
        self._bar = None

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled:
            return
        if self._bar is None:
            try:
                from tqdm import tqdm
            except ImportError:  # tqdm comes with the 'export' extra; without it, no bar
                self.enabled = False
                return
            self._bar = tqdm(total=total, unit="B", unit_scale=True, desc=self.desc, file=sys.stderr,
                             dynamic_ncols=True, leave=False)
        self._bar.update(done - self._bar.n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
