"""One rank of a 2-rank gloo job exercising the load policy (tests/test_load_policy.py).

Phases (argument `phase`), each writing OUT_DIR/<phase>-rank<r>.json:
- "own-copy": each rank loads the newest step of its own copy of the job (node-local
  copies: `job` is a directory holding copy0/, copy1/), with fallback, through ckpt.load.
- "alone": both ranks open a Checkpointer on `job` with a mirror; only rank 0 loads, by
  explicit step 1, while rank 1 calls nothing for up to 20 s (it waits for rank 0's
  "loaded" file), so a load by explicit step that wanted a collective would stall there.
Run as a multiprocessing (spawn) target: `entry(rank, world, port, phase, job, mirror, out)`.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
import traceback
from typing import Any


def _own_copy(rank: int, job: str) -> dict[str, Any]:
    import torch

    import ckpt

    state = {"w": torch.zeros(64)}
    res = ckpt.load(state, os.path.join(job, f"copy{rank}"))
    return {
        "step": res.step,
        "w0": float(state["w"][0]),
        "fell_back_from": res.fell_back_from,
        "quarantined": res.quarantined,
    }


def _alone(rank: int, job: str, mirror: str, out_dir: str) -> dict[str, Any]:
    import ckpt

    flag = os.path.join(out_dir, "alone-loaded")
    result: dict[str, Any] = {}
    with ckpt.Checkpointer(job, mirror=mirror) as cp:
        if rank == 0:
            res = cp.load({}, step=1)
            result["step"] = res.step
            with open(flag, "w") as f:
                f.write("1")
        else:
            deadline = time.monotonic() + 20
            while not os.path.exists(flag) and time.monotonic() < deadline:
                time.sleep(0.05)
            result["saw_rank0_load"] = os.path.exists(flag)
    return result


def _run(rank: int, world: int, phase: str, job: str, mirror: str, out_dir: str) -> None:
    import torch.distributed as dist

    result: dict[str, Any] = {"rank": rank, "error": None}
    try:
        dist.init_process_group(
            "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60)
        )
        if phase == "own-copy":
            result.update(_own_copy(rank, job))
        else:
            result.update(_alone(rank, job, mirror, out_dir))
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the test
        result["error"] = traceback.format_exc()
    with open(os.path.join(out_dir, f"{phase}-rank{rank}.json"), "w") as f:
        json.dump(result, f)


def entry(rank: int, world: int, port: int, phase: str, job: str, mirror: str, out: str) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    log = os.open(
        os.path.join(out, f"{phase}-rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644
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
    _run(rank, world, phase, job, mirror, out)
    sys.stdout.flush()
    sys.stderr.flush()
