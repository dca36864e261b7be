"""Counting what the reliability suite injects, for bench/reliability_report.py.

Tests wrap each injected fault or bad input in a tally block:

    with tally.fault("crash:rank.mid_write"):
        ...inject, then check the invariants...

The block counts one injection; it counts as survived only if the block exits without
an exception (the invariant checks passed), and the exception still fails the test.
`bad_input` works the same way: the block must prove the input got a clear error.
`load` records the figures of one load run.

With $CKPT_TALLY_FILE unset (the normal test run) nothing is written, so the tally
costs nothing; the report sets it and sums the JSON lines afterwards. Each record is
one small O_APPEND write, so rank processes and xdist workers can share the file.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

TALLY_ENV = "CKPT_TALLY_FILE"


class Tally:
    def __init__(self, test: str) -> None:
        self.test = test
        self.path = os.environ.get(TALLY_ENV) or None

    def _write(self, record: dict[str, Any]) -> None:
        if self.path is None:
            return
        line = json.dumps({"test": self.test, **record}, sort_keys=True) + "\n"
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)

    @contextmanager
    def _counted(self, table: str, kind: str) -> Iterator[None]:
        try:
            yield
        except BaseException:
            self._write({"table": table, "kind": kind, "ok": False})
            raise
        self._write({"table": table, "kind": kind, "ok": True})

    def fault(self, kind: str) -> AbstractContextManager[None]:
        """One injected fault of `kind`; survived if the block raises nothing."""
        return self._counted("fault", kind)

    def bad_input(self, kind: str) -> AbstractContextManager[None]:
        """One bad input of `kind`; a clear error if the block raises nothing."""
        return self._counted("bad_input", kind)

    def load(self, kind: str, **figures: float | int) -> None:
        """The figures of one load run (ranks, saves, rpcs, p99_ms, lost, rss_mib, ...)."""
        self._write({"table": "load", "kind": kind, "ok": True, **figures})
