"""ckptctl verify: sizes and blake3 hashes of committed steps, and with --coordinator each
manifest against the digest the catalog recorded at commit. A step that is not there is
reported as absent, not as corrupt."""

from __future__ import annotations

import argparse
import sys
import time

from ckptd.cli.ctl.connection import coordinator_client
from ckptd.cli.ctl.output import (
    OK,
    PROBLEM,
    emit_json,
    human_bytes,
    human_seconds,
    job_path,
)
from ckptd.cli.ctl.progress import progress_bar, step_bytes
from ckptd.errors import CheckpointNotFound, CkptError
from ckptd.format import checkpoint as ckfmt
from ckptd.format import layout
from ckptd.storage import Storage


def cmd_verify(storage: Storage, args: argparse.Namespace) -> int:
    if args.all:
        steps = [s.step for s in ckfmt.list_steps(storage) if s.status != ckfmt.INCOMPLETE]
        if not steps:
            return _no_checkpoint(storage, args)
    else:
        try:
            steps = [ckfmt.resolve_step(storage, args.step)]
        except CkptError as e:
            return _no_checkpoint(storage, args, str(e))
        absent = _absent_step(storage, steps[0]) if args.step is not None else None
        if absent:  # nothing to verify: not a corrupt checkpoint, a step that is not there
            return _no_checkpoint(storage, args, absent)
    catalog = _CatalogDigests(args) if args.coordinator else None
    reports, seconds = [], []
    try:
        for step in steps:
            total = step_bytes(storage, step)
            bar = progress_bar(total, f"verify step {step}", args)
            expected, unknown = catalog.digest(step) if catalog else (None, None)
            t0 = time.perf_counter()
            try:
                report = ckfmt.verify_checkpoint(
                    storage,
                    step,
                    level=args.level,
                    progress=bar.update if bar else None,
                    manifest_blake3=expected,
                )
            finally:
                if bar:
                    bar.close()
            seconds.append(time.perf_counter() - t0)
            if unknown:
                report.problems.insert(0, unknown)
            reports.append(report)
    finally:
        if catalog:
            catalog.close()
    ok = all(r.ok for r in reports)
    bad = [r for r in reports if not r.ok]
    error = (
        f"{storage.url}: step(s) {', '.join(str(r.step) for r in bad)} failed verification "
        f"({sum(len(r.problems) for r in bad)} problem(s); the first: {bad[0].problems[0]}). "
        "Checkpoints with problems must not be loaded: load an earlier step "
        "(ckpt.load(..., step=N)) or restore from a replica"
        if bad
        else None
    )
    if args.json:
        emit_json(
            args,
            {
                "path": storage.url,
                "ok": ok,
                **({"error": error, "exit_code": PROBLEM} if error else {}),
                "steps": [
                    {
                        "step": r.step,
                        "ok": r.ok,
                        "level": r.level,
                        "bytes_checked": r.bytes_checked,
                        "seconds": round(t, 6),
                        "problems": r.problems,
                    }
                    for r, t in zip(reports, seconds, strict=True)
                ],
            },
        )
    else:
        for r, t in zip(reports, seconds, strict=True):
            if r.ok:
                print(
                    f"step {r.step}: OK ({r.level}, {human_bytes(r.bytes_checked)} checked "
                    f"in {human_seconds(t)})"
                )
            else:
                print(f"step {r.step}: CORRUPT ({len(r.problems)} problem(s))")
                for p in r.problems:
                    print(f"  - {p}")
    if error:
        print(f"error: {error}", file=sys.stderr)
    return OK if ok else PROBLEM


def _absent_step(storage: Storage, step: int) -> str | None:
    """Why an explicitly asked step has nothing to check (None when it has a manifest)."""
    sdir = layout.step_dir(step)
    if storage.exists(f"{sdir}/{layout.MANIFEST_NAME}"):
        return None
    if storage.exists(sdir):
        return (
            f"{storage.url}/{sdir} has no {layout.MANIFEST_NAME}: step {step} never committed "
            "(an unfinished save; `ckptctl gc` removes it)"
        )
    have = [s.step for s in ckfmt.list_steps(storage) if s.status != ckfmt.INCOMPLETE]
    listed = ", ".join(map(str, have[-10:])) if have else "none"
    return f"{storage.url} has no step {step} (steps with a manifest: {listed}); see `ckptctl list`"


class _CatalogDigests:
    """verify --coordinator: each step's manifest digest as the catalog recorded it."""

    def __init__(self, args: argparse.Namespace):
        self.address, self.path = args.coordinator, job_path(args)
        self.client = coordinator_client(args)

    def digest(self, step: int) -> tuple[str | None, str | None]:
        """(digest to check, or None; a problem to report when the catalog has none)."""
        try:
            info = self.client.get_checkpoint(self.path, step)
        except CheckpointNotFound:
            return None, (
                f"step {step} is not in the catalog of coordinator {self.address}: it was not "
                "committed through it (if the catalog was lost: ckptd rebuild-catalog)"
            )
        if not info.manifest_blake3:
            return None, (
                f"step {step} has a manifest in storage but the catalog of {self.address} "
                f"says {info.status} ({info.reason or 'no commit recorded'})"
            )
        return info.manifest_blake3, None

    def close(self) -> None:
        self.client.close()


def _no_checkpoint(storage: Storage, args: argparse.Namespace, why: str | None = None) -> int:
    msg = why or f"{storage.url} holds no committed checkpoint"
    print(f"error: {msg}", file=sys.stderr)
    if args.json:
        doc = {"path": storage.url, "ok": False, "steps": [], "error": msg, "exit_code": PROBLEM}
        emit_json(args, doc)
    return PROBLEM
