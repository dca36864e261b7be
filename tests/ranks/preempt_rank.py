"""A training loop with save_on_preemption, for the preemption tests.

    python preempt_rank.py JOB OUT_DIR [--every N] [--steps N] [--step-s S]

One process, or one rank of several (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT in the
environment: gloo, one all_reduce per step, as DDP would). After each step it rewrites
OUT_DIR/rank<r>.step with the step just trained, calls maybe_save, and sleeps step_s. The
test sends a signal; the rank must take the last checkpoint, print what it did, and
leave through SystemExit, so the `finally` below runs and says so.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time

import torch

import ckpt


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("job")
    p.add_argument("out")
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--steps", type=int, default=100_000)
    p.add_argument("--step-s", type=float, default=0.02)
    args = p.parse_args()
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        import torch.distributed as dist

        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    torch.manual_seed(0)
    state = {"w": torch.zeros(64, 64), "step": 0, "mine": ckpt.PerRank(torch.zeros(3) + rank)}
    last = 0
    try:
        with ckpt.Checkpointer(args.job, save_on_preemption=True, lease_s=5, timeout_s=30) as cp:
            start = cp.resume(state) or 0
            for step in range(start + 1, args.steps + 1):
                g = torch.ones(64, 64) * step
                if world > 1:
                    import torch.distributed as dist

                    dist.all_reduce(g)  # a collective every step: the ranks move in lockstep
                state["w"] += g
                state["step"] = last = step
                with open(os.path.join(args.out, f"rank{rank}.step"), "w") as f:
                    f.write(str(step))
                pending = cp.maybe_save(state, step, every=args.every)
                if pending is not None:
                    print(f"rank {rank}: save of step {pending.step}", flush=True)
                time.sleep(args.step_s)
    finally:
        print(f"rank {rank}: finally ran after step {last}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
