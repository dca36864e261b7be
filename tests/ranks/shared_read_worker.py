"""One rank of a gloo (CPU) job whose loads read each stored byte once (ckpt._shared_read).

Run as a multiprocessing (spawn) target: `entry(rank, world, port, mode, job, out_dir)`.

mode "save": every rank saves steps 1 and 2 of the state below through the zero-config
coordinator: `rep.*` replicated (the same on every rank), `half` a DTensor Shard(0) (each
rank its rows). mode "save-rows": step 1, then step 2 incremental with a few elements of
some tensors changed (`rows_state`: with a small CKPT_BLOCK_SIZE, entries that borrow
some blocks); "load:<read>:rows" checks against those values. mode "load:<read>[:<keys>]": every rank loads the newest step into zeros
with ckpt.load(read=...) (keys: a glob, or all) and checks its values bit-exactly. Each
rank writes OUT_DIR/<mode>-rank<r>.json with the bytes this process read from storage
(ckptd.storage.counters), the load's result and its checks.
"""

from __future__ import annotations

import os
import zlib
from typing import Any

from ranks.gloo_rank import run_rank

REP = {f"rep.{i}": 1 << 18 for i in range(6)}  # 6 x 1 MiB of float32, replicated
HALF_ROWS, HALF_COLS = 512, 256  # 512 KiB of float32 rows per rank


def value(key: str, step: int, shape: tuple[int, ...]) -> Any:
    import torch

    g = torch.Generator().manual_seed(zlib.crc32(f"{key}/{step}".encode()))
    return torch.randn(shape, generator=g)


def state(world: int, step: int | None) -> dict[str, Any]:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    out: dict[str, Any] = {}
    for key, n in REP.items():
        out[key] = value(key, step, (n,)) if step is not None else torch.zeros(n)
    full = (
        value("half", step, (HALF_ROWS * world, HALF_COLS))
        if step is not None
        else torch.zeros(HALF_ROWS * world, HALF_COLS)
    )
    out["half"] = distribute_tensor(full, mesh, [Shard(0)])
    return out


def rows_state(world: int, step: int) -> dict[str, Any]:
    """Step 1's state, and at step 2 a few elements of rep.0, rep.3 and half changed."""
    out = state(world, 1)
    if step == 2:
        for key in ("rep.0", "rep.3"):
            out[key][[5, 200_000]] += 1.0
        local = out["half"].to_local()
        local[[3, HALF_ROWS - 1]] += 1.0
    return out


def save(rank: int, world: int, job: str, rows: bool = False) -> dict[str, Any]:
    import ckpt

    with ckpt.Checkpointer(job, incremental=rows) as cp:
        for step in (1, 2):
            cp.save(rows_state(world, step) if rows else state(world, step), step, blocking=True)
    return {}


def load(rank: int, world: int, job: str, mode: str) -> dict[str, Any]:
    import torch

    import ckpt
    from ckptd.storage import counters

    _, read, *rest = mode.split(":")
    keys = rest[0] if rest and rest[0] not in ("corrupt-transfer", "rows") else None
    if "corrupt-transfer" in rest and rank == 1:
        _corrupt_what_rank_receives()
    target = state(world, None)
    before = counters.snapshot()
    try:
        res = ckpt.load(target, job, read=read, keys=keys)
    except ckpt.CkptError as e:
        return {"load_error": f"{type(e).__name__}: {e}"}
    got = counters.snapshot() - before
    want = rows_state(world, res.step) if "rows" in rest else state(world, res.step)
    checks = {}
    for key, t in target.items():
        if keys is not None and not key.startswith(keys.rstrip("*")):
            continue
        a = t.to_local() if hasattr(t, "to_local") else t
        b = want[key].to_local() if hasattr(want[key], "to_local") else want[key]
        checks[key] = bool(torch.equal(a, b))
    return {
        "read_bytes": got.read_bytes,
        "checks": checks,
        "result": {
            "step": res.step,
            "fell_back_from": res.fell_back_from,
            "fallback_reason": res.fallback_reason,
            "quarantined": res.quarantined,
        },
    }


def _corrupt_what_rank_receives() -> None:
    """A bit flipped on the way between ranks: what no storage check can see (the only
    fault here that cannot happen for real on loopback, so it is injected)."""
    from ckpt import _shared_read

    real = _shared_read._transfer

    def flipping(win, bufs, peers, stats):  # type: ignore[no-untyped-def]
        real(win, bufs, peers, stats)
        for p in win:
            if p.reader != peers.rank and peers.rank in p.needers:
                bufs[id(p)][7] ^= 0x10
                return

    _shared_read._transfer = flipping


def _name(mode: str) -> str:
    return mode.replace(":", "_").replace("*", "x").replace("/", "_")


def entry(rank: int, world: int, port: int, mode: str, job: str, out_dir: str) -> None:
    run_rank(
        rank,
        world,
        port,
        log=os.path.join(out_dir, f"{_name(mode)}-rank{rank}.log"),
        result=os.path.join(out_dir, f"{_name(mode)}-rank{rank}.json"),
        body=lambda: (
            save(rank, world, job, rows=mode == "save-rows")
            if mode.startswith("save")
            else load(rank, world, job, mode)
        ),
        base={"rank": rank, "checks": {}},
    )
