"""ckptctl inspect: a committed step's manifest and tensors (what each borrows from earlier
steps), and with --stats each floating-point tensor's health recorded at save time."""

from __future__ import annotations

import argparse
import json
from typing import Any

from ckptd.cli.ctl.output import OK, emit_json, human_bytes, print_table, when
from ckptd.format import checkpoint as ckfmt
from ckptd.format import health, layout, values
from ckptd.storage import Storage


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
        emit_json(
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
        f"step       {m.step}   (generation {m.generation}, {m.world_size} rank(s), created {when(m.created_unix)})"
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
    print_table(rows, ["KEY", "DTYPE", "SHAPE", "SIZE", "RANK", "BORROWED"])
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
    print_table(rows, ["", "KEY", "DTYPE", "NORM", "MAX|X|", "NAN", "INF", ""])
    sick = [k for k in stats if k.finite is False]
    unknown = [k for k in stats if k.finite is None]
    print(
        f"health     {len(stats)} floating-point tensor(s): "
        + (f"{len(sick)} with NaN or Inf values" if sick else "all finite")
        + (f", {len(unknown)} without stats (saved before ckptd recorded them)" if unknown else "")
    )
