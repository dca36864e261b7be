"""One rank of a torchrun job that opens the same job's Checkpointer twice in one launch
(as a second trainer.train() does): each must reach its own zero-config coordinator.

    python -m torch.distributed.run --standalone --nproc-per-node 2 reopen_worker.py JOB
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

import ckpt


def main(job: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for step in (1, 2, 3):
        with ckpt.Checkpointer(job) as cp:  # closed (its coordinator stopped) each time
            cp.save({"w": ckpt.PerRank(torch.full((64,), float(step + rank)))}, step).wait()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
