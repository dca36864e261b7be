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

import logging
import os
from typing import Any

from ranks.gloo_rank import run_rank

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
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import ckpt

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
    return out


def entry(rank: int, world: int, port: int, job: str, out_dir: str) -> None:
    run_rank(
        rank,
        world,
        port,
        log=os.path.join(out_dir, f"rank{rank}.log"),
        result=os.path.join(out_dir, f"rank{rank}.json"),
        body=lambda: _run(rank, world, job),
        base={"rank": rank, "error": None},
    )
