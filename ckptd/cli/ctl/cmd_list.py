"""ckptctl list: a job's steps, their status and lineage, from storage (with --mirror, which
tiers hold each) or, with --coordinator, as the coordinator's catalog sees them."""

from __future__ import annotations

import argparse
import os
from typing import Any

from ckptd.cli.ctl.connection import coordinator_client
from ckptd.cli.ctl.output import OK, emit_json, fail, human_bytes, job_path, print_table, when
from ckptd.format import checkpoint as ckfmt
from ckptd.storage import JobLocation, Storage, open_storage


def _tiers_of(storage: Storage, args: argparse.Namespace) -> dict[int, list[str]] | None:
    """With --mirror: for each step, the tiers whose copy is committed ("local", "mirror")."""
    if not getattr(args, "mirror", None):
        return None
    held: dict[int, list[str]] = {}
    for name, st in (("local", storage), ("mirror", open_storage(args.mirror))):
        for step in ckfmt.committed_steps(st):
            held.setdefault(step, []).append(name)
    return held


def cmd_list(storage: Storage, args: argparse.Namespace) -> int:
    tiers = _tiers_of(storage, args)
    steps = ckfmt.list_steps(storage)
    if tiers is not None:
        # Steps only the mirror holds are listed too (as the mirror sees them).
        local = {s.step for s in steps}
        mirror = [s for s in ckfmt.list_steps(open_storage(args.mirror)) if s.step not in local]
        steps = sorted(steps + mirror, key=lambda s: s.step)
    # The lineage: which steps are the live line (what resume loads, what keep_last
    # retires from) and which an abandoned branch after a rollback (docs/concepts.md).
    line = ckfmt.line_of(steps)
    head = ckfmt.head_of(steps)

    def lineage(s: ckfmt.StepInfo) -> str:
        if s.manifest is None:
            return "-"
        return "head" if s.step == head else "live" if s.step in line else "abandoned"

    if args.json:
        emit_json(
            args,
            {
                "path": storage.url,
                "steps": [
                    {
                        "step": s.step,
                        "status": s.status,
                        "bytes": sum(x.size for x in s.manifest.shards) if s.manifest else None,
                        "world_size": s.manifest.world_size if s.manifest else None,
                        "created_unix": s.manifest.created_unix if s.manifest else None,
                        "parent": s.manifest.parent if s.manifest else None,
                        "line": lineage(s) if s.manifest else None,
                        "error": s.error,
                        **({"tiers": tiers.get(s.step, [])} if tiers is not None else {}),
                    }
                    for s in steps
                ],
            },
        )
        return OK
    if not steps:
        print(f"{storage.url}: no checkpoints")
        return OK
    rows = []
    for s in steps:
        m = s.manifest
        if m is not None:
            rows.append(
                [
                    str(s.step),
                    s.status,
                    human_bytes(sum(x.size for x in m.shards)),
                    str(m.world_size),
                    "-" if m.parent is None else str(m.parent),
                    lineage(s),
                    when(m.created_unix),
                ]
            )
        else:
            rows.append([str(s.step), s.status, "-", "-", "-", "-", s.error or ""])
    header = ["STEP", "STATUS", "SIZE", "RANKS", "PARENT", "LINE", "CREATED"]
    if tiers is not None:
        for row, s in zip(rows, steps, strict=True):
            row.insert(2, ",".join(tiers.get(s.step, [])) or "-")
        header.insert(2, "TIERS")
    print_table(rows, header)
    for s in steps:
        if s.status == ckfmt.QUARANTINED:
            print(f"step {s.step} is quarantined (loads without a step skip it): {s.error}")
    abandoned = [s.step for s in steps if lineage(s) == "abandoned"]
    if abandoned:
        print(
            f"steps {abandoned} are off the live line (a rollback abandoned them): resume does "
            "not load them and keep_last does not retire them; they stay until you remove "
            "their step directories (or load one and save on from it to make it live)"
        )
    return OK


def cmd_list_coordinator(args: argparse.Namespace) -> int:
    """Steps as the coordinator's catalog sees them, aborted and open saves included."""
    job = job_path(args)
    client = coordinator_client(args)
    try:
        infos = client.list_checkpoints(job)
    finally:
        client.close()
    if not infos and not JobLocation.of(job).is_url and not os.path.isdir(job):
        # The coordinator may serve a disk this host does not see; with no saves there
        # either, PATH names nothing: a typo, as for the commands that read storage.
        return fail(
            args,
            f"{job} does not exist here and coordinator {args.coordinator} knows no saves "
            "of it; pass the job's checkpoint directory",
        )
    rows: list[dict[str, Any]] = [
        {
            "step": i.step,
            "status": i.status,
            "generation": i.generation,
            "world_size": i.world_size,
            "bytes": i.bytes,
            "reason": i.reason,
            "created_unix": i.created_unix,
            "manifest_blake3": i.manifest_blake3,
        }
        for i in infos
    ]
    if args.json:
        emit_json(args, {"path": job, "coordinator": args.coordinator, "steps": rows})
        return OK
    if not rows:
        print(f"{job}: no saves known to {args.coordinator}")
        return OK
    print_table(
        [
            [
                str(r["step"]),
                r["status"],
                human_bytes(r["bytes"]),
                str(r["world_size"]),
                str(r["generation"]),
                r["reason"][:80],
            ]
            for r in rows
        ],
        ["STEP", "STATUS", "SIZE", "RANKS", "GEN", "REASON"],
    )
    return OK
