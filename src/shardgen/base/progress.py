"""Progress bars that stay readable in a Slurm log file.

On a terminal this is an ordinary tqdm bar. In a file (a Slurm job's log),
tqdm's carriage-return updates would pile up on one line; there the bar
prints a whole line at most every 30 seconds instead.
"""

from __future__ import annotations

import sys
from typing import Any, TextIO

from tqdm import tqdm

LOG_INTERVAL_S = 30.0


class _Lines:
    """A file wrapper that turns tqdm's in-place updates into separate lines."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def write(self, s: str) -> None:
        s = s.replace("\r", "").replace("\x1b[A", "").strip()
        if s:
            self._stream.write(s + "\n")

    def flush(self) -> None:
        self._stream.flush()


class _Bar(tqdm):
    """tqdm with an output-token counter shown as tokens/s."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tokens = 0

    def update(self, n: float = 1, tokens: int = 0) -> bool | None:
        self.tokens += tokens
        elapsed = self.format_dict["elapsed"]
        if tokens and elapsed > 0:
            self.set_postfix_str(f"{self.tokens / elapsed:.1f} tok/s", refresh=False)
        return super().update(n)


def progress_bar(total: int, initial: int = 0, desc: str = "", stream: TextIO | None = None) -> _Bar:
    stream = stream or sys.stderr
    interactive = hasattr(stream, "isatty") and stream.isatty()
    return _Bar(
        total=total,
        initial=initial,
        desc=desc,
        unit="row",
        file=stream if interactive else _Lines(stream),
        mininterval=0.5 if interactive else LOG_INTERVAL_S,
        dynamic_ncols=interactive,
        ncols=None if interactive else 100,
        ascii=not interactive,
    )
