"""ckptctl restore: a consolidated copy of a step as safetensors, torch or zarr (the work is
ckptd.export's; this module draws its progress and reports it)."""

from __future__ import annotations

import argparse
from typing import Any

from ckptd.cli.ctl.output import OK, emit_json, human_bytes, human_seconds
from ckptd.cli.ctl.progress import progress_bar
from ckptd.storage import Storage


def cmd_restore(storage: Storage, args: argparse.Namespace) -> int:
    """A consolidated (unsharded) copy of a step, every byte verified on the way."""
    # Imported by the command that needs it: the exports bring torch (and tensorstore).
    from ckptd.export import export_checkpoint

    bar: Any = None

    def size_hint(total: int) -> None:
        nonlocal bar
        bar = progress_bar(
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
        emit_json(
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
