"""ckptctl gc: debris of unfinished saves, stray files, recycled shard files, unfinished
uploads and, when asked, old, quarantined or abandoned steps. What retention removes is
ckptd.coordinator.retention's to say; gc adds only what the user asks for beyond it, and
tolerates a save removing the same things while it runs."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from functools import partial

from ckptd.cli.ctl.output import OK, UsageError, emit_json
from ckptd.cli.ctl.progress import progress_bar, tick
from ckptd.coordinator import retention
from ckptd.format import checkpoint as ckfmt
from ckptd.format import layout, recycle
from ckptd.storage import Storage
from ckptd.storage.base import PendingUpload


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
        line = set(retention.live_line(states))
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
        else progress_bar(len(doomed_steps) + len(strays) + len(pool), "gc", args, "items")
    )
    try:
        for step, reason in doomed_steps:
            sdir = layout.step_dir(step)
            if not args.dry_run:
                _remove_racing(storage, sdir, partial(ckfmt.remove_step, storage, step))
            tick(bar)
            if not args.json:
                print(f"{verb} {sdir} ({reason})")
        for path in strays:
            if not args.dry_run:
                _remove_racing(storage, path, partial(storage.remove_tree, path))
            tick(bar)
            if not args.json:
                print(f"{verb} {path} (not part of the committed step)")
        for name in pool:
            if not args.dry_run:
                entry = f"{recycle.POOL}/{name}"
                _remove_racing(storage, entry, partial(storage.remove_tree, entry))
            tick(bar)
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
        emit_json(
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
