"""One rank of a gloo (CPU) job whose loads read each stored byte once (ckpt._shared_read).

Run as a multiprocessing (spawn) target: `entry(rank, world, port, mode, job, out_dir)`.

mode "save": every rank saves steps 1 and 2 of the state below through the zero-config
coordinator: `rep.*` replicated (the same on every rank), `half` a DTensor Shard(0) (each
rank its rows). mode "load:<read>[:<keys>]": every rank loads the newest step into zeros
with ckpt.load(read=...) (keys: a glob, or all) and checks its values bit-exactly. Each
rank writes OUT_DIR/<mode>-rank<r>.json with the bytes this process read from storage
(ckptd.storage.counters), the load's result and its checks.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import traceback
import zlib
from typing import Any

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


def save(rank: int, world: int, job: str) -> dict[str, Any]:
    import ckpt

    with ckpt.Checkpointer(job) as cp:
        for step in (1, 2):
            cp.save(state(world, step), step, blocking=True)
    return {}


def load(rank: int, world: int, job: str, mode: str) -> dict[str, Any]:
    import torch

    import ckpt
    from ckptd.storage import counters

    _, read, *rest = mode.split(":")
    keys = rest[0] if rest and rest[0] != "corrupt-transfer" else None
    if "corrupt-transfer" in rest and rank == 1:
        _corrupt_what_rank_receives()
    target = state(world, None)
    before = counters.snapshot()
    try:
        res = ckpt.load(target, job, read=read, keys=keys)
    except ckpt.CkptError as e:
        return {"load_error": f"{type(e).__name__}: {e}"}
    got = counters.snapshot() - before
    want = state(world, res.step)
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


def _run(rank: int, world: int, mode: str, job: str, out_dir: str) -> int:
    import torch.distributed as dist

    result: dict[str, Any] = {"rank": rank, "checks": {}}
    code = 0
    try:
        dist.init_process_group(
            "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60)
        )
        try:
            result.update(
                save(rank, world, job) if mode == "save" else load(rank, world, job, mode)
            )
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported through the result file
        result["error"] = traceback.format_exc()
        traceback.print_exc()
        code = 1
    with open(os.path.join(out_dir, f"{_name(mode)}-rank{rank}.json"), "w") as f:
        json.dump(result, f)
    return code


def _name(mode: str) -> str:
    return mode.replace(":", "_").replace("*", "x").replace("/", "_")


def entry(rank: int, world: int, port: int, mode: str, job: str, out_dir: str) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    log = os.open(
        os.path.join(out_dir, f"{_name(mode)}-rank{rank}.log"),
        os.O_WRONLY | os.O_CREAT | os.O_TRUNC,
        0o644,
    )
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
    )
    code = _run(rank, world, mode, job, out_dir)
    sys.stdout.flush()
    sys.stderr.flush()
    if code:
        sys.exit(code)
