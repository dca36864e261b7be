"""One rank of a 2-rank gloo job saving to s3:// through the fault proxy
(tests/test_store_faults.py): step 1 commits; the proxy fails every part of rank 1's
shard of step 2, so rank 1's save fails on its upload and rank 0 must learn it from the
coordinator (SaveAborted naming rank 1), not wait at a barrier; both then load step 1.

Run as a multiprocessing (spawn) target: `spawn_entry(rank, world, port, url, out_dir)`;
the endpoint and the short store bounds come in the environment (CKPT_STORE_*).
"""

from __future__ import annotations

import os
import time
from typing import Any


def state(rank: int, step: int) -> dict[str, Any]:
    import torch

    import ckpt

    g = torch.Generator().manual_seed(100 * step + rank)
    return {"own": ckpt.PerRank(torch.randn((12 << 20) // 4, generator=g)), "step": step}


def _body(rank: int, url: str) -> dict[str, Any]:
    import torch

    import ckpt

    out: dict[str, Any] = {}
    with ckpt.Checkpointer(url) as cp:
        cp.save(state(rank, 1), 1, blocking=True)
        t0 = time.monotonic()
        try:
            cp.save(state(rank, 2), 2, blocking=True)
            out["step2"] = "committed"
        except ckpt.CkptError as e:
            out["step2"] = f"{type(e).__name__}: {e}"
        out["step2_s"] = time.monotonic() - t0
        fresh = state(rank, 0)
        fresh["own"] = ckpt.PerRank(torch.zeros_like(fresh["own"].value))
        out["resumed"] = cp.resume(fresh)
        out["exact"] = bool(torch.equal(fresh["own"].value, state(rank, 1)["own"].value))
    return out


def spawn_entry(rank: int, world: int, port: int, url: str, out_dir: str) -> None:
    from ranks.gloo_rank import run_rank

    run_rank(
        rank,
        world,
        port,
        log=os.path.join(out_dir, f"rank{rank}.log"),
        result=os.path.join(out_dir, f"rank{rank}.json"),
        body=lambda: _body(rank, url),
    )
