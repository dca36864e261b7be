"""ckptctl: list, inspect, verify, diff, restore and garbage-collect checkpoints, from storage alone.

Exit codes: 0 all good, 1 a problem was found (corrupt, missing, no checkpoint, no such
step, a path that is not a job directory, storage that refused an operation; `diff
--exit-code`: the steps differ), 2 usage error. `--json` prints exactly one JSON document on
stdout, also on failure ({"command", "path", "ok": false, "error", "exit_code"}); every
document has "command", "path" (absolute, or the URL) and "ok" (docs/cli.md has each
command's schema). Human text goes to stdout, errors to stderr as one `error:` line;
progress bars go to stderr, only when it is a terminal and never with --json. Every
CkptError and OSError a command meets ends in that error line (and document), never a
traceback: `main` is the one place that turns them into exit codes.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

from ckptd.coordinator import retention
from ckptd.errors import CheckpointNotFound, CkptError
from ckptd.format import checkpoint as ckfmt
from ckptd.format import health, layout, recycle, values
from ckptd.server.client import CoordinatorClient
from ckptd.storage import JobLocation, Storage, open_storage
from ckptd.storage.base import PendingUpload

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


def _when(ts: float) -> str:
    """Local time and age: '2026-11-30 08:53:44 (3 h 05 min ago)'."""
    age = time.time() - ts
    ago = f" ({human_seconds(age)} ago)" if age >= 0 else ""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts)) + ago


def _print_table(rows: list[list[str]], header: list[str]) -> None:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    print("  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)).rstrip())
    for r in rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())


def _job_path(args: argparse.Namespace) -> str:
    """The job as storage names it: a local PATH made absolute (relative to the current
    directory), a URL as written. What every JSON document says, and what ckptctl asks a
    coordinator about."""
    try:
        return JobLocation.of(args.path).path
    except (CkptError, ValueError):  # reported by whatever opens it; the document still goes out
        return str(args.path)


def _emit_json(args: argparse.Namespace, doc: dict[str, Any]) -> None:
    """The one JSON document of a --json run; every one has command, path and ok."""
    head = {
        "command": args.command,
        "path": doc.pop("path", None) or _job_path(args),
        "ok": doc.pop("ok", True),
    }
    json.dump({**head, **doc}, sys.stdout, indent=2)
    sys.stdout.write("\n")


# --------------------------------------------------------------------------- commands


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
        _emit_json(
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
                    _when(m.created_unix),
                ]
            )
        else:
            rows.append([str(s.step), s.status, "-", "-", "-", "-", s.error or ""])
    header = ["STEP", "STATUS", "SIZE", "RANKS", "PARENT", "LINE", "CREATED"]
    if tiers is not None:
        for row, s in zip(rows, steps, strict=True):
            row.insert(2, ",".join(tiers.get(s.step, [])) or "-")
        header.insert(2, "TIERS")
    _print_table(rows, header)
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
    job = _job_path(args)
    client = coordinator_client(args)
    try:
        infos = client.list_checkpoints(job)
    finally:
        client.close()
    if not infos and not JobLocation.of(job).is_url and not os.path.isdir(job):
        # The coordinator may serve a disk this host does not see; with no saves there
        # either, PATH names nothing: a typo, as for the commands that read storage.
        return _fail(
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
        _emit_json(args, {"path": job, "coordinator": args.coordinator, "steps": rows})
        return OK
    if not rows:
        print(f"{job}: no saves known to {args.coordinator}")
        return OK
    _print_table(
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


def cmd_inspect(storage: Storage, args: argparse.Namespace) -> int:
    ck = ckfmt.open_checkpoint(storage, args.step)
    m = ck.manifest
    entries: list[dict[str, Any]] = []
    for chunks in ck.chunks.values():
        for c in chunks:
            lent = [p for _, p in ck.pieces(c.entry) if layout.split_borrowed(p.file) is not None]
            entries.append(
                {
                    "key": c.entry.key,
                    "dtype": c.entry.dtype,
                    "shape": c.entry.shape,
                    "chunk_offsets": c.entry.chunk_offsets,
                    "chunk_sizes": c.entry.chunk_sizes,
                    "bytes": c.entry.length,
                    "rank": c.shard.rank,
                    "file": c.entry.file or c.shard.path,
                    "offset": c.entry.offset,
                    "borrowed_bytes": sum(p.length for p in lent),
                    "borrowed_blocks": sum(len(p.blake3) for p in lent),
                    "borrowed_from": c.entry.lenders,
                }
            )
    plain = sum(1 for leaf in values.leaves(m.state) if values.tensor_ref(leaf) is None)
    stats = health.key_health(ck) if args.stats else None
    if args.json:
        _emit_json(
            args,
            {
                "path": storage.url,
                "step": m.step,
                "generation": m.generation,
                "world_size": m.world_size,
                "created_unix": m.created_unix,
                "block_size": m.block_size,
                "bytes": ck.total_bytes,
                "owned_bytes": ck.owned_bytes,
                "borrowed_bytes": ck.borrowed_bytes,
                "borrows": m.borrows,
                "metadata": m.metadata,
                "shards": [s.to_json() for s in m.shards],
                "tensors": entries,
                "plain_values": plain,
                **({} if stats is None else {"stats": [k.to_json() for k in stats]}),
            },
        )
        return OK
    print(f"job        {storage.url}")
    print(
        f"step       {m.step}   (generation {m.generation}, {m.world_size} rank(s), created {_when(m.created_unix)})"
    )
    print(
        f"size       {human_bytes(ck.total_bytes)} in {len(m.shards)} shard(s), block {human_bytes(m.block_size)}"
    )
    if m.borrows:
        lenders = ", ".join(map(str, m.borrows[:8])) + (" ..." if len(m.borrows) > 8 else "")
        print(
            f"owns       {human_bytes(ck.owned_bytes)} of tensor bytes; borrows "
            f"{human_bytes(ck.borrowed_bytes)} from step(s) {lenders} (an incremental save)"
        )
    else:
        print(f"owns       {human_bytes(ck.owned_bytes)} of tensor bytes; borrows none")
    if m.metadata:
        print(f"metadata   {json.dumps(m.metadata)[:200]}")
    print(f"values     {len(ck.chunks)} tensors, {plain} plain values")
    print()
    rows = [
        [
            e["key"],
            e["dtype"],
            "x".join(map(str, e["shape"])) or "()",
            human_bytes(e["bytes"]),
            str(e["rank"]),
            _borrowed_cell(e),
        ]
        for e in entries
    ]
    _print_table(rows, ["KEY", "DTYPE", "SHAPE", "SIZE", "RANK", "BORROWED"])
    if stats is not None:
        print()
        _print_stats(stats)
    return OK


def _borrowed_cell(e: dict[str, Any]) -> str:
    """inspect's BORROWED column: '-', 'step N' (all of the chunk), or how much of it."""
    if not e["borrowed_from"]:
        return "-"
    steps = "step " + ", ".join(map(str, e["borrowed_from"]))
    if e["borrowed_bytes"] == e["bytes"]:
        return steps
    return f"{human_bytes(e['borrowed_bytes'])} ({e['borrowed_blocks']} blocks) from {steps}"


def _print_stats(stats: list[health.KeyHealth]) -> None:
    """inspect --stats: each floating-point tensor's health, its chunks combined; a tensor
    with NaN or Inf values is marked '!' and counted at the end."""
    rows = []
    for k in stats:
        s = k.stats
        if s is None:
            rows.append([" ", k.key, k.dtype, "-", "-", "-", "-", "no stats"])
            continue
        rows.append(
            [
                " " if s.finite else "!",
                k.key,
                k.dtype,
                f"{s.norm:.6g}",
                f"{s.max_abs:.6g}",
                str(s.nan),
                str(s.inf),
                f"{k.chunks} chunk(s)" if k.chunks > 1 else "",
            ]
        )
    _print_table(rows, ["", "KEY", "DTYPE", "NORM", "MAX|X|", "NAN", "INF", ""])
    sick = [k for k in stats if k.finite is False]
    unknown = [k for k in stats if k.finite is None]
    print(
        f"health     {len(stats)} floating-point tensor(s): "
        + (f"{len(sick)} with NaN or Inf values" if sick else "all finite")
        + (f", {len(unknown)} without stats (saved before ckptd recorded them)" if unknown else "")
    )


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
            total = _step_bytes(storage, step)
            bar = _progress(total, f"verify step {step}", args)
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
        _emit_json(
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
        self.address, self.path = args.coordinator, _job_path(args)
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


def add_coordinator_options(sp: argparse.ArgumentParser, what: str) -> None:
    """--coordinator and the connection options, the same on every command that asks one."""
    sp.add_argument("--coordinator", metavar="ADDR", help=what)
    sp.add_argument("--token", help="coordinator token (default $CKPTD_TOKEN)")
    sp.add_argument("--tls-root-cert", metavar="PEM", help="CA of a TLS coordinator")
    sp.add_argument(
        "--tls-client-cert",
        metavar="PEM",
        help="client certificate, for a coordinator that requires mutual TLS (with --tls-client-key)",
    )
    sp.add_argument("--tls-client-key", metavar="PEM", help="the client certificate's key")


def coordinator_client(args: argparse.Namespace) -> CoordinatorClient:
    """The client of `args.coordinator`, from the options add_coordinator_options added.

    A person waits at the terminal: a coordinator that is down or mistyped is reported
    within a few seconds, not after the training client's retries.
    """
    if bool(args.tls_client_cert) != bool(args.tls_client_key):
        raise UsageError("--tls-client-cert and --tls-client-key go together (mutual TLS)")
    key, cert = _read_file(args.tls_client_key), _read_file(args.tls_client_cert)
    return CoordinatorClient(
        args.coordinator,
        token=args.token or os.environ.get("CKPTD_TOKEN"),
        root_certificates=_read_file(args.tls_root_cert),
        client_cert=(key, cert) if key is not None and cert is not None else None,
        retry_for_s=10,
        connect_retry_s=2,
    )


def _read_file(path: str | None) -> bytes | None:
    if path is None:
        return None
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise UsageError(f"cannot read {path}: {e.strerror or e}") from None


def _no_checkpoint(storage: Storage, args: argparse.Namespace, why: str | None = None) -> int:
    msg = why or f"{storage.url} holds no committed checkpoint"
    print(f"error: {msg}", file=sys.stderr)
    if args.json:
        doc = {"path": storage.url, "ok": False, "steps": [], "error": msg, "exit_code": PROBLEM}
        _emit_json(args, doc)
    return PROBLEM


def _step_bytes(storage: Storage, step: int) -> int:
    try:
        return sum(s.size for s in ckfmt.read_manifest(storage, step).shards)
    except CkptError:
        return 0


class _Bar:
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


def _progress(total: int, desc: str, args: argparse.Namespace, unit: str = "bytes") -> _Bar | None:
    """A bar only for a person watching: stderr is a terminal, no --json, no --no-progress."""
    if args.json or getattr(args, "no_progress", False) or not sys.stderr.isatty() or total <= 0:
        return None
    return _Bar(total, desc, unit)


def _stray_files(storage: Storage, committed: list[ckfmt.StepInfo]) -> list[str]:
    """Files inside committed steps that their manifest does not name: shards of a fenced
    or aborted generation, temporary files of an interrupted write."""
    out = []
    for info in committed:
        m = info.manifest
        if m is None:
            continue
        sdir = layout.step_dir(info.step)
        named = {x for sh in m.shards for x in (sh.path, sh.index)}
        for name in storage.listdir(f"{sdir}/{layout.SHARDS_DIR}"):
            if f"{layout.SHARDS_DIR}/{name}" not in named:
                out.append(f"{sdir}/{layout.SHARDS_DIR}/{name}")
        for name in storage.listdir(sdir):
            if name not in (layout.MANIFEST_NAME, layout.SHARDS_DIR, ckfmt.QUARANTINE_NAME):
                out.append(f"{sdir}/{name}")
    return out


def cmd_gc(storage: Storage, args: argparse.Namespace) -> int:
    if args.keep_last is not None and args.keep_last < 1:
        raise UsageError("--keep-last must be at least 1 (the newest checkpoint is always kept)")
    steps = ckfmt.list_steps(storage)
    # What retention would remove is the retention rule's to say (ckptd.coordinator.retention:
    # debris below the live line's newest step, the line behind its newest N); gc adds only
    # what the user asks for beyond it.
    states = retention.from_storage(storage)
    plan = retention.plan(states, args.keep_last or len(states) + 1)
    why = {s.step: f"{s.status.lower()}: {s.error}" for s in steps}
    doomed: dict[int, str] = {k: why[k] for k in plan.debris}
    doomed.update((k, "retired by --keep-last") for k in plan.retire if args.keep_last)
    if args.include_newer:
        doomed.update((s.step, why[s.step]) for s in steps if s.status == ckfmt.INCOMPLETE)
    if args.quarantined:
        doomed.update(
            (s.step, f"quarantined: {(s.error or '')[:120]}")
            for s in steps
            if s.status == ckfmt.QUARANTINED
        )
    if args.abandoned:
        line = set(
            ckfmt.live_line(
                (s for s in states if s.status in (retention.COMMITTED, retention.QUARANTINED)),
                gaps={
                    s.step
                    for s in states
                    if s.status in (retention.UNFINISHED, retention.UNREADABLE)
                },
            )
        )
        doomed.update(
            (s.step, "abandoned: off the live line (a rollback left it)")
            for s in states
            if s.status in (retention.COMMITTED, retention.QUARANTINED) and s.step not in line
        )
    # A step a kept step borrows bytes from (an incremental save) stays, whatever asked for
    # its removal: the retention rule's to say (retention.keep_borrowed).
    held = retention.keep_borrowed(states, doomed) | set(plan.held if args.keep_last else ())
    for k in sorted(held):
        doomed.pop(k, None)
        if not args.json:
            print(f"kept {layout.step_dir(k)} (a step that stays borrows bytes from it)")
    doomed_steps = sorted(doomed.items())
    strays = _stray_files(
        storage, [s for s in steps if s.status in (ckfmt.COMMITTED, ckfmt.QUARANTINED)]
    )
    pool = [] if args.keep_recycled else storage.listdir(recycle.POOL)
    uploads = _stray_uploads(storage, steps, doomed)
    verb = "would remove" if args.dry_run else "removed"
    bar = (
        None
        if args.dry_run
        else _progress(len(doomed_steps) + len(strays) + len(pool), "gc", args, "items")
    )
    try:
        for step, reason in doomed_steps:
            sdir = layout.step_dir(step)
            if not args.dry_run:
                _remove_racing(storage, sdir, partial(ckfmt.remove_step, storage, step))
            _tick(bar)
            if not args.json:
                print(f"{verb} {sdir} ({reason})")
        for path in strays:
            if not args.dry_run:
                _remove_racing(storage, path, partial(storage.remove_tree, path))
            _tick(bar)
            if not args.json:
                print(f"{verb} {path} (not part of the committed step)")
        for name in pool:
            if not args.dry_run:
                entry = f"{recycle.POOL}/{name}"
                _remove_racing(storage, entry, partial(storage.remove_tree, entry))
            _tick(bar)
        for up, why_up, action in uploads:
            if action == "abort" and not args.dry_run:
                storage.abort_upload(up)  # under a removed step, remove_tree did it
            if not args.json:
                done = "kept" if action == "keep" else "would abort" if args.dry_run else "aborted"
                print(f"{done} unfinished upload {up.path} ({why_up})")
    finally:
        if bar is not None:
            bar.close()
    if pool and not args.json:
        print(f"{verb} {len(pool)} retired shard file(s) kept for reuse in {recycle.POOL}")
    if args.json:
        _emit_json(
            args,
            {
                "path": storage.url,
                "dry_run": args.dry_run,
                "removed": [s for s, _ in doomed_steps],
                "held": sorted(held),
                "steps": [{"step": s, "reason": r} for s, r in doomed_steps],
                "stray_files": strays,
                "recycled_files": len(pool),
                "uploads": [
                    {"path": u.path, "upload_id": u.upload_id, "kept": a == "keep", "reason": r}
                    for u, r, a in uploads
                ],
            },
        )
    elif not doomed and not pool and not strays and not uploads:
        print("nothing to remove")
    return OK


def _stray_uploads(
    storage: Storage, steps: Sequence[ckfmt.StepInfo], doomed: dict[int, str]
) -> list[tuple[PendingUpload, str, str]]:
    """Unfinished multipart uploads under the job (S3 bills their parts): (upload, why,
    "abort" | "with_step" | "keep"). Those under a step gc removes go with it (remove_tree aborts them; listed
    here); under a committed step or outside any step they belong to nothing; under an
    unfinished step gc keeps, a save may still be sending them."""
    status = {s.step: s.status for s in steps}
    out: list[tuple[PendingUpload, str, str]] = []
    for up in storage.pending_uploads(""):
        step = layout.parse_step_dir(up.path.split("/", 1)[0])
        if step is None:
            out.append((up, "outside any step", "abort"))
        elif step in doomed:
            out.append((up, f"with {layout.step_dir(step)}: {doomed[step]}", "with_step"))
        elif status.get(step) in (ckfmt.COMMITTED, ckfmt.QUARANTINED):
            out.append((up, "not part of the committed step", "abort"))
        else:
            out.append(
                (
                    up,
                    f"a save of step {step} may be running; --include-newer removes it",
                    "keep",
                )
            )
    return out


def _remove_racing(storage: Storage, path: str, remove: Callable[[], None]) -> None:
    """Run `remove` (of `path`) while another process may be removing or renaming under it.

    A save's retention retiring the same step, or a save taking a recycled file from the
    pool, makes a file vanish between gc's look and its unlink: FileNotFoundError mid-way.
    What is gone is what gc wanted; what is left (the other side is not done yet) is
    removed again. Anything else, or a tree that keeps coming back, is an error.
    """
    for _ in range(5):
        try:
            remove()
            return
        except FileNotFoundError:
            if not storage.exists(path):
                return
    remove()


def _tick(bar: _Bar | None) -> None:
    if bar is not None:
        bar.update(1)


def cmd_diff(storage: Storage, args: argparse.Namespace) -> int:
    """Which tensors and values changed between two steps, from the indexes' block hashes
    where the chunk layouts match, else by reading and hashing the whole tensors."""
    # Imported by the command that needs it: ckptctl's other commands start faster.
    from ckptd.format.diff import ADDED, CHANGED, REMOVED, KeyDiff, diff_checkpoints

    if not args.norm_jump > 1:
        raise UsageError(f"--norm-jump must be above 1, got {args.norm_jump}")

    bar = _progress(
        _step_bytes(storage, args.step_a) + _step_bytes(storage, args.step_b),
        f"diff {args.step_a} {args.step_b} (reading where layouts differ)",
        args,
    )
    try:
        rep = diff_checkpoints(
            storage,
            args.step_a,
            args.step_b,
            progress=bar.update if bar else None,
            factor=args.norm_jump,
        )
    finally:
        if bar is not None:
            bar.close()
    shown = [k for k in rep.keys if args.all or k.status != "same" or k.flags]
    if args.json:
        _emit_json(
            args,
            {
                "path": storage.url,
                "step_a": rep.step_a,
                "step_b": rep.step_b,
                "identical": rep.identical,
                "changed": [k.key for k in rep.of(CHANGED)],
                "added": [k.key for k in rep.of(ADDED)],
                "removed": [k.key for k in rep.of(REMOVED)],
                "unchanged": len(rep.of("same")),
                "bytes_read": rep.bytes_read,
                "norm_jump": args.norm_jump,
                "stand_out": [k.key for k in rep.stand_out],
                "keys": [k.to_json() for k in shown],
            },
        )
    else:
        mark = {CHANGED: "M", ADDED: "A", REMOVED: "D", "same": "="}

        def norm(k: KeyDiff) -> str:
            n = k.norm
            if n is None or (k.status == "same" and not k.flags):
                return ""
            ratio = f" (x{n['ratio']:.3g})" if n["ratio"] is not None else " (from 0)"
            out = f"\n    norm {n['norm_a']:.6g} -> {n['norm_b']:.6g}{ratio}"
            if health.JUMP in k.flags:
                out += f"  !! norm changed more than x{args.norm_jump:g}"
            if health.NONFINITE in k.flags:
                out += f"  !! NaN/Inf {n['nonfinite_a']} -> {n['nonfinite_b']}"
            return out

        for k in shown:
            how = (
                f" ({k.by}{': ' + k.detail if k.detail else ''})"
                if k.kind == "tensor" and k.status == CHANGED
                else ""
            )
            tag = "" if k.kind == "tensor" else " [value]"
            print(f"{'!' if k.flags else mark[k.status]} {k.key}{tag}{how}{norm(k)}")
        print(
            f"step {rep.step_a} -> {rep.step_b}: {len(rep.of(CHANGED))} changed, "
            f"{len(rep.of(ADDED))} added, {len(rep.of(REMOVED))} removed, "
            f"{len(rep.of('same'))} unchanged"
            + (f" ({human_bytes(rep.bytes_read)} read)" if rep.bytes_read else "")
            + (
                f"; {len(rep.stand_out)} stand out (norm changed more than "
                f"x{args.norm_jump:g}, or new NaN/Inf)"
                if rep.stand_out
                else ""
            )
        )
    return PROBLEM if args.exit_code and not rep.identical else OK


def cmd_restore(storage: Storage, args: argparse.Namespace) -> int:
    """A consolidated (unsharded) copy of a step, every byte verified on the way."""
    # Imported by the command that needs it: the exports bring torch (and tensorstore).
    from ckptd.export import export_checkpoint

    bar: Any = None

    def size_hint(total: int) -> None:
        nonlocal bar
        bar = _progress(
            total, f"restore step {args.step if args.step is not None else 'newest'}", args
        )

    def progress(n: int) -> None:
        if bar is not None:
            bar.update(n)

    try:
        res = export_checkpoint(
            storage,
            args.to,
            fmt=args.format,
            step=args.step,
            keys=args.keys,
            progress=progress,
            size_hint=size_hint,
            zarr_keep_bfloat16=args.zarr_keep_bfloat16,
            overwrite=args.force,
        )
    finally:
        if bar is not None:
            bar.close()
    if args.json:
        _emit_json(
            args,
            {
                "path": storage.url,
                "ok": True,
                "step": res.step,
                "format": res.format,
                "to": res.path,
                "tensors": res.tensors,
                "bytes": res.bytes,
                "bytes_verified": res.bytes_read,
                "seconds": res.seconds,
                "keys": res.keys,
            },
        )
    else:
        print(
            f"restored step {res.step}: {res.tensors} tensor(s), {human_bytes(res.bytes)} "
            f"({human_bytes(res.bytes_read)} read and verified) -> {res.path} ({res.format}) "
            f"in {human_seconds(res.seconds)}"
        )
    return OK


# --------------------------------------------------------------------------- parsing


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ckptctl",
        description="List, inspect, verify, diff, restore and clean up ckptd checkpoints, "
        "from storage alone.",
        epilog="exit codes: 0 ok; 1 a problem was found (corrupt or missing data, no such "
        "step; diff --exit-code: the steps differ); 2 usage error. --json: one JSON document "
        "on stdout, also on failure (docs/cli.md).",
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, help: str) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help, description=help)
        sp.add_argument(
            "path", metavar="PATH", help="the job's checkpoint directory (or fsspec URL)"
        )
        sp.add_argument("--json", action="store_true", help="print one JSON document on stdout")
        return sp

    sp = add("list", "list the steps of a job and their status")
    add_coordinator_options(sp, "ask a running coordinator (shows OPEN and ABORTED saves too)")
    sp.add_argument(
        "--mirror",
        metavar="URL",
        help="the job's mirror tier (e.g. s3://bucket/job): show which tiers hold each step",
    )
    sp = add("inspect", "show a committed step's manifest and tensors")
    sp.add_argument("--step", type=int, help="step (default: newest committed)")
    sp.add_argument(
        "--stats",
        action="store_true",
        help="also each floating-point tensor's health (L2 norm, max |x|, NaN and Inf counts) "
        "recorded at save time",
    )
    sp = add("verify", "check sizes and blake3 hashes of committed steps")
    g = sp.add_mutually_exclusive_group()
    g.add_argument("--step", type=int, help="step (default: newest committed)")
    g.add_argument("--all", action="store_true", help="every committed step")
    sp.add_argument(
        "--level",
        choices=("size", "full"),
        default="full",
        help="size: presence and sizes; full: re-read and hash every byte (default)",
    )
    sp.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_coordinator_options(
        sp,
        "also check each manifest against the blake3 the coordinator's catalog recorded "
        "at commit (detects a consistent rewrite of shards, indexes and manifest)",
    )
    sp = add("gc", "remove debris of unfinished saves and, optionally, old steps")
    sp.add_argument("--keep-last", type=int, help="also remove committed steps beyond the newest N")
    sp.add_argument(
        "--include-newer",
        action="store_true",
        help="also remove unfinished steps newer than the newest committed one (only when no save is running)",
    )
    sp.add_argument(
        "--quarantined",
        action="store_true",
        help="also remove steps quarantined after failing verification at load time",
    )
    sp.add_argument(
        "--abandoned",
        action="store_true",
        help="also remove committed steps off the live line (a branch a rollback left)",
    )
    sp.add_argument("--dry-run", action="store_true", help="show what would be removed")
    sp.add_argument("--no-progress", action="store_true", help="no progress bar")
    sp.add_argument(
        "--keep-recycled", action="store_true", help="keep retired shard files kept for reuse"
    )
    sp = add(
        "restore",
        "write a consolidated (unsharded) copy of a step as safetensors, torch or zarr, "
        "verifying every byte",
    )
    sp.add_argument("--step", type=int, help="step (default: newest committed)")
    sp.add_argument("--to", required=True, metavar="OUT", help="output file (zarr: directory)")
    sp.add_argument(
        "--format",
        required=True,
        choices=("safetensors", "torch", "zarr"),
        help="safetensors: one file (safetensors.torch.load_file); torch: one file "
        "(torch.load(weights_only=True)); zarr: a Zarr v3 hierarchy (docs/restore.md)",
    )
    sp.add_argument(
        "--keys",
        action="append",
        metavar="PATTERN",
        help="only tensors whose keys match this glob (repeatable; 'model' also means 'model/*')",
    )
    sp.add_argument(
        "--zarr-keep-bfloat16",
        action="store_true",
        help="zarr: write bfloat16 as tensorstore's bfloat16 type (readable by tensorstore and "
        "JAX, not by zarr-python) instead of its raw bits as uint16",
    )
    sp.add_argument("--force", action="store_true", help="replace OUT if it exists")
    sp.add_argument("--no-progress", action="store_true", help="no progress bar")
    sp = add(
        "diff",
        "which tensors and values changed, were added or removed between two committed steps "
        "(by blake3; data is read only where the chunk layouts differ)",
    )
    sp.add_argument("step_a", metavar="STEP_A", type=int)
    sp.add_argument("step_b", metavar="STEP_B", type=int)
    sp.add_argument("--all", action="store_true", help="also list the unchanged keys")
    sp.add_argument(
        "--exit-code", action="store_true", help="exit 1 when the steps differ (like git diff)"
    )
    sp.add_argument(
        "--norm-jump",
        type=float,
        default=health.DEFAULT_JUMP,
        metavar="FACTOR",
        help="mark a tensor whose L2 norm grew or shrank by more than FACTOR (default 2)",
    )
    sp.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


COMMANDS = {
    "list": cmd_list,
    "inspect": cmd_inspect,
    "verify": cmd_verify,
    "gc": cmd_gc,
    "restore": cmd_restore,
    "diff": cmd_diff,
}


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0) if e.code in (0, None) else USAGE
    try:
        if args.command == "list" and args.coordinator:
            return cmd_list_coordinator(args)
        storage = open_storage(args.path)
        not_a_job = _not_a_job(storage, args)
        if not_a_job:
            return _fail(args, not_a_job)
        return COMMANDS[args.command](storage, args)
    except UsageError as e:
        return _fail(args, str(e), USAGE)
    except (ValueError, CkptError) as e:
        usage = isinstance(e, ValueError) and not isinstance(e, CkptError)
        return _fail(args, str(e), USAGE if usage else PROBLEM)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # `ckptctl inspect --json | head`: the reader left; no traceback, and no second
        # error when Python flushes stdout at exit.
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):  # stdout is not a file (in-process runs)
            pass
        return PROBLEM
    except OSError as e:  # storage refused (read-only, permissions, a full disk, EIO)
        return _fail(args, _os_error(e, args))


def _not_a_job(storage: Storage, args: argparse.Namespace) -> str | None:
    """Why PATH cannot be a job's checkpoint directory (None when it can be one)."""
    local = storage.local_path("")
    if local is not None and os.path.lexists(local) and not os.path.isdir(local):
        return (
            f"{_job_path(args)} is a file, not a job's checkpoint directory (the directory "
            "that holds its step-* directories)"
        )
    if not storage.exists(""):
        return f"{_job_path(args)} does not exist; pass the job's checkpoint directory"
    return None


def _os_error(e: OSError, args: argparse.Namespace) -> str:
    """An OSError as one line: the file, what the system said (with the errno's name) and
    what to do about it."""
    name = errno.errorcode.get(e.errno or 0, "")
    where = e.filename or _job_path(args)
    msg = f"{where}: {e.strerror or e}" + (f" ({name})" if name else "")
    if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        msg += (
            f"; ckptctl {args.command} needs to write there: run it where the storage is "
            "writable, as a user allowed to write it"
        )
    elif e.errno == errno.ENOSPC:
        msg += "; the filesystem is full: free space (ckptctl gc --keep-last N)"
    return msg


def _fail(args: argparse.Namespace, msg: str, code: int = PROBLEM) -> int:
    """The error on stderr; with --json also the one JSON document, so scripts can parse it."""
    print(f"error: {msg}", file=sys.stderr)
    if args.json:
        _emit_json(args, {"ok": False, "error": msg, "exit_code": code})
    return code


if __name__ == "__main__":
    sys.exit(main())
