"""One rank of a 2-rank gloo job whose later steps hold NaN/Inf (tests/test_health_stats.py).

Both ranks save steps 1-4 of {"w": a DTensor of rows sharded over the 2 ranks, "rep": a
replica} through the zero-config coordinator. Step 3 has an Inf in rank 0's rows and a
NaN in rank 1's; step 4 a NaN in rank 1's rows only, so rank 0's own chunk is clean and
only the whole step's indexes say it is sick. Then a new Checkpointer (a restart) resumes
with require_finite, one without, and both ranks load keys="rep" with require_finite.
Writes OUT_DIR/rank<r>.json: the steps, whether the values are the step's, the messages
the ckpt logger gave at WARNING and above, and the error (traceback or null).
Run as a multiprocessing (spawn) target: `entry(rank, world, port, job, out_dir)`.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import sys
import traceback
from typing import Any

ROWS, COLS = 8, 6


def full(step: int):  # noqa: ANN201 - a torch.Tensor, torch imported in the rank
    import torch

    w = torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS) * step
    if step == 3:
        w[0, 0] = float("inf")  # rank 0's rows [0, 4)
        w[6, 1] = float("nan")  # rank 1's rows [4, 8)
    if step == 4:
        w[7, 5] = float("nan")
    return w


class _Messages(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _run(rank: int, world: int, job: str) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import ckpt

    dist.init_process_group(
        "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60)
    )
    mesh = init_device_mesh("cpu", (world,))

    def state(step: int) -> dict[str, Any]:
        return {
            "w": distribute_tensor(full(step), mesh, [Shard(0)]),
            "rep": torch.full((5,), float(step)),
        }

    with ckpt.Checkpointer(job) as cp:
        for step in (1, 2, 3, 4):
            cp.save(state(step), step, blocking=True)
    messages = _Messages()
    logging.getLogger("ckpt").addHandler(messages)
    out: dict[str, Any] = {}
    with ckpt.Checkpointer(job) as cp:
        target = state(0)
        out["resumed"] = cp.resume(target, require_finite=True)
        mine = full(2)[rank * 4 : rank * 4 + 4]
        out["values_are_step_2"] = bool(torch.equal(target["w"].to_local(), mine)) and bool(
            torch.equal(target["rep"], torch.full((5,), 2.0))
        )
        out["unhealthy"] = cp.last_load.unhealthy if cp.last_load is not None else None
        out["messages"] = list(messages.lines)
        messages.lines.clear()
        out["resumed_without"] = cp.resume(state(0))
        rep = {"rep": torch.zeros(5)}
        res = cp.load(rep, keys="rep", require_finite=True)
        out["rep_step"] = res.step
        out["rep_messages"] = list(messages.lines)
    dist.destroy_process_group()
    return out


def entry(rank: int, world: int, port: int, job: str, out_dir: str) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    log = os.open(
        os.path.join(out_dir, f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644
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
    result: dict[str, Any] = {"rank": rank, "error": None}
    try:
        result.update(_run(rank, world, job))
    except BaseException:  # noqa: BLE001 - reported to the test
        result["error"] = traceback.format_exc()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    sys.stdout.flush()
    sys.stderr.flush()
