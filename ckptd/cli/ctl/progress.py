"""ckptctl's progress bars: on stderr, and only for a person watching (a terminal, no
--json, no --no-progress). rich is imported only when a bar is drawn, so scripts and pipes
never pay for it.
"""

from __future__ import annotations

import argparse
import sys

from ckptd.errors import CkptError
from ckptd.format import checkpoint as ckfmt
from ckptd.storage import Storage


class Bar:
    """A rich progress bar on stderr; update() may be called from the reader threads."""

    def __init__(self, total: int, desc: str, unit: str):
        # rich is imported only when a bar is drawn (a terminal, not --json).
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )

        amount = (
            [DownloadColumn(binary_units=True), TransferSpeedColumn()]
            if unit == "bytes"
            else [MofNCompleteColumn()]
        )
        self._progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            *amount,
            TimeRemainingColumn(),
            console=Console(file=sys.stderr),
            transient=True,  # the summary line replaces it
        )
        self._progress.start()
        self._task = self._progress.add_task(desc, total=total)

    def update(self, n: int) -> None:
        self._progress.update(self._task, advance=n)

    def close(self) -> None:
        self._progress.stop()


def progress_bar(
    total: int, desc: str, args: argparse.Namespace, unit: str = "bytes"
) -> Bar | None:
    """A bar only for a person watching: stderr is a terminal, no --json, no --no-progress."""
    if args.json or getattr(args, "no_progress", False) or not sys.stderr.isatty() or total <= 0:
        return None
    return Bar(total, desc, unit)


def tick(bar: Bar | None) -> None:
    if bar is not None:
        bar.update(1)


def step_bytes(storage: Storage, step: int) -> int:
    try:
        return sum(s.size for s in ckfmt.read_manifest(storage, step).shards)
    except CkptError:
        return 0
