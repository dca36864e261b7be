"""ckptctl diff: which tensors and values changed between two committed steps, and which
tensors' norms jumped or turned NaN/Inf."""

from __future__ import annotations

import argparse

from ckptd.cli.ctl.output import OK, PROBLEM, UsageError, emit_json, human_bytes
from ckptd.cli.ctl.progress import progress_bar, step_bytes
from ckptd.format import health
from ckptd.storage import Storage


def cmd_diff(storage: Storage, args: argparse.Namespace) -> int:
    """Which tensors and values changed between two steps, from the indexes' block hashes
    where the chunk layouts match, else by reading and hashing the whole tensors."""
    # Imported by the command that needs it: ckptctl's other commands start faster.
    from ckptd.format.diff import ADDED, CHANGED, REMOVED, KeyDiff, diff_checkpoints

    if not args.norm_jump > 1:
        raise UsageError(f"--norm-jump must be above 1, got {args.norm_jump}")

    bar = progress_bar(
        step_bytes(storage, args.step_a) + step_bytes(storage, args.step_b),
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
        emit_json(
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
