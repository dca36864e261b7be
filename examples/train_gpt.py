"""A tiny GPT trained on several CPU ranks, checkpointed with ckpt: the training loop of the demo.

    python -m torch.distributed.run --nproc-per-node 2 --max-restarts 1 \\
        examples/train_gpt.py --ckpt demo-ckpts/gpt --steps 60 --save-every 5

A character-level GPT (token and position embeddings, causal self-attention blocks, an
MLP, weight-tied head) learns the Zen of Python, which ships with Python. DDP over gloo
averages the gradients. Everything that decides what happens next is in the checkpoint:
model, optimizer, learning-rate schedule, the data sampler's position and every rank's
random number generators, so a resumed run continues bit for bit as if nothing happened.

The checkpoint loop is three calls: Checkpointer(...) (rank 0 hosts the coordinator, the
other ranks find it through torch.distributed's store), resume(state) and, after each
step, maybe_save(state, step, every=N), which saves asynchronously: training goes on
while the bytes are hashed, written and verified in the background.

--crash-at STEP: on the first attempt only, rank 1 is killed with SIGKILL in the middle of
writing its shard of the save at STEP (ckptd's crash point `rank.mid_write`), so that
torchrun restarts the workers and they resume from the last committed checkpoint.
Rank 0 writes a summary (--out) of what happened in each attempt.
"""

from __future__ import annotations

import argparse
import codecs
import contextlib
import datetime
import io
import json
import logging
import math
import os
import random
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ckpt


def corpus() -> str:
    with contextlib.redirect_stdout(io.StringIO()):
        import this  # noqa: F401 - prints the Zen of Python on import; caught above
    return codecs.decode(this.s, "rot13")


class Block(nn.Module):
    def __init__(self, d: int, heads: int, block: int, dropout: float):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.drop = nn.Dropout(dropout)
        self.register_buffer("mask", torch.ones(block, block, dtype=torch.bool).tril())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        att = att.masked_fill(~self.mask[:t, :t], float("-inf")).softmax(dim=-1)
        y = (self.drop(att) @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.drop(self.proj(y))
        return x + self.drop(self.mlp(self.ln2(x)))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, heads: int, block: int, dropout: float):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(block, d)
        self.blocks = nn.Sequential(*[Block(d, heads, block, dropout) for _ in range(layers)])
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied: saved once, restored tied
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t))
        return self.head(self.ln(self.blocks(x)))


class WindowSampler:
    """Random text windows, a different shuffle per epoch, a disjoint slice per rank.

    Its state is its position (epoch, batches taken): equal on every rank, so it is saved
    once; restored, the run draws exactly the batches it would have drawn.
    """

    def __init__(self, n_tokens: int, block: int, batch: int, seed: int, rank: int, world: int):
        self.starts = n_tokens - block - 1
        self.block, self.batch, self.seed = block, batch, seed
        self.rank, self.world = rank, world
        self.epoch, self.taken = 0, 0

    def _order(self) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        return torch.randperm(self.starts, generator=g)[self.rank :: self.world]

    def next_batch(self, data: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        order = self._order()
        if (self.taken + 1) * self.batch > len(order):
            self.epoch, self.taken = self.epoch + 1, 0
            order = self._order()
        idx = order[self.taken * self.batch : (self.taken + 1) * self.batch]
        self.taken += 1
        x = torch.stack([data[i : i + self.block] for i in idx.tolist()])
        y = torch.stack([data[i + 1 : i + 1 + self.block] for i in idx.tolist()])
        return x, y

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "taken": self.taken}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.taken = int(state["epoch"]), int(state["taken"])


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ckpt", required=True, help="the job's checkpoint directory")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--save-every", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--block", type=int, default=32)
    p.add_argument("--batch", type=int, default=8, help="per rank")
    p.add_argument(
        "--lease", type=float, default=5.0, help="seconds before a silent rank aborts a save"
    )
    p.add_argument(
        "--crash-at",
        type=int,
        default=None,
        help="kill -9 rank 1 mid-save at this step (first attempt)",
    )
    p.add_argument("--out", default=None, help="rank 0 appends a JSON line per attempt here")
    p.add_argument("--print-every", type=int, default=5)
    return p.parse_args()


def say(msg: str) -> None:
    print(f"[train] {msg}", flush=True)


def main() -> int:
    args = parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    # ckpt logs why it skips a checkpoint and what the coordinator aborted or recovered.
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter(f"[ckpt] rank {rank}: %(message)s"))
    for name in ("ckpt", "ckptd"):
        logging.getLogger(name).addHandler(handler)
        logging.getLogger(name).setLevel(logging.WARNING)

    text = corpus()
    chars = sorted(set(text))
    data = torch.tensor([chars.index(c) for c in text], dtype=torch.long)
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = TinyGPT(len(chars), args.d_model, args.layers, args.heads, args.block, dropout=0.1)
    ddp = DDP(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    warmup = max(1, args.steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda s: (
            min(1.0, (s + 1) / warmup)
            * 0.5
            * (1 + math.cos(math.pi * min(s, args.steps) / args.steps))
        ),
    )
    sampler = WindowSampler(len(data), args.block, args.batch, args.seed, rank, world)
    rank_seed = args.seed * 7919 + 1 + rank  # dropout (and anything random) differs per rank
    torch.manual_seed(rank_seed)
    np.random.seed(rank_seed)
    random.seed(rank_seed)
    state = {
        "model": model,
        "optim": opt,
        "sched": sched,
        "sampler": sampler,
        "rng": ckpt.PerRank(ckpt.RNGState()),
        "step": 0,
    }

    cp = ckpt.Checkpointer(
        args.ckpt, keep_last=3, lease_s=args.lease, timeout_s=60, save_on_preemption=True
    )
    t0 = time.perf_counter()
    resumed = cp.resume(state)
    start = resumed or 0
    if rank == 0:
        where = (
            f"resumed from step {resumed}"
            if resumed is not None
            else "no checkpoint: starting fresh"
        )
        say(
            f"attempt {attempt} (coordinator generation {cp.generation}), {world} ranks: {where}"
            + (f" in {time.perf_counter() - t0:.2f} s" if resumed is not None else "")
        )

    loss_g = torch.zeros(())
    saves: list[int] = []
    for step in range(start + 1, args.steps + 1):
        x, y = sampler.next_batch(data)
        loss = F.cross_entropy(ddp(x).flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        state["step"] = step
        loss_g = loss.detach().clone()
        dist.all_reduce(loss_g)
        loss_g /= world
        if args.crash_at == step and attempt == 0 and rank == 1:
            say(
                f"rank 1: kill -9 of this rank planned in the middle of writing step {step}'s shard"
            )
            cp.wait()  # so that the crash point fires in this step's save, not the previous one's
            os.environ["CKPT_CRASH_AT"] = "rank.mid_write"
        pending = cp.maybe_save(
            state, step, every=args.save_every, metadata={"loss": float(loss_g)}
        )
        if pending is not None:
            saves.append(step)
        if rank == 0 and (step % args.print_every == 0 or step == start + 1):
            blocking = (
                f"  save started, training blocked {pending.blocking_s * 1e3:.1f} ms"
                if pending
                else ""
            )
            say(f"step {step:4d}  loss {float(loss_g):.4f}{blocking}")
    if saves[-1:] != [args.steps] and start < args.steps:
        cp.save(state, args.steps, metadata={"loss": float(loss_g)})
        saves.append(args.steps)
    cp.wait()
    if rank == 0:
        say(f"trained to step {args.steps}; last checkpoint committed: step {cp.latest_step()}")
        if args.out:
            with open(args.out, "a") as f:
                doc = {
                    "attempt": attempt,
                    "generation": cp.generation,
                    "resumed_from": resumed,
                    "saves": saves,
                    "final_loss": float(loss_g).hex(),
                    "steps": args.steps,
                }
                f.write(json.dumps(doc) + "\n")
    cp.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
