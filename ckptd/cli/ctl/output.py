"""What a ckptctl run says: exit codes, human units and tables, the one JSON document of a
--json run, and the error line.

Every command writes through these, so every document has "command", "path" and "ok", and
every failure is one `error:` line on stderr (and, with --json, its document on stdout).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from ckptd.errors import CkptError
from ckptd.storage import JobLocation

OK, PROBLEM, USAGE = 0, 1, 2


class UsageError(Exception):
    """Arguments that parse but make no sense together: exit code 2."""


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def human_seconds(s: float) -> str:
    if s < 1:
        return f"{s * 1000:.0f} ms"
    if s < 60:
        return f"{s:.1f} s"
    if s < 3600:
        return f"{int(s // 60)} min {int(s % 60):02d} s"
    if s < 86400:
        return f"{int(s // 3600)} h {int(s % 3600 // 60):02d} min"
    return f"{int(s // 86400)} d {int(s % 86400 // 3600):02d} h"


def when(ts: float) -> str:
    """Local time and age: '2026-11-30 08:53:44 (3 h 05 min ago)'."""
    age = time.time() - ts
    ago = f" ({human_seconds(age)} ago)" if age >= 0 else ""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts)) + ago


def print_table(rows: list[list[str]], header: list[str]) -> None:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    print("  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)).rstrip())
    for r in rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())


def job_path(args: argparse.Namespace) -> str:
    """The job as storage names it: a local PATH made absolute (relative to the current
    directory), a URL as written. What every JSON document says, and what ckptctl asks a
    coordinator about."""
    try:
        return JobLocation.of(args.path).path
    except (CkptError, ValueError):  # reported by whatever opens it; the document still goes out
        return str(args.path)


def emit_json(args: argparse.Namespace, doc: dict[str, Any]) -> None:
    """The one JSON document of a --json run; every one has command, path and ok."""
    head = {
        "command": args.command,
        "path": doc.pop("path", None) or job_path(args),
        "ok": doc.pop("ok", True),
    }
    json.dump({**head, **doc}, sys.stdout, indent=2)
    sys.stdout.write("\n")


def fail(args: argparse.Namespace, msg: str, code: int = PROBLEM) -> int:
    """The error on stderr; with --json also the one JSON document, so scripts can parse it."""
    print(f"error: {msg}", file=sys.stderr)
    if args.json:
        emit_json(args, {"ok": False, "error": msg, "exit_code": code})
    return code
