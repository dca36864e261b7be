"""Incremental saves by block hash: bytes written and save time, saved every step.

One run, methods interleaved inside every repetition (a slow period of the disk hits all
of them), each repetition one training step:

  LoRA-style state   a frozen bf16 base (`--base-gib`, default 2 GiB: a llama-like decoder,
                     weights only) plus rank-`--rank` LoRA adapters on q/k/v/o of every
                     layer with their fp32 Adam moments (a few percent of the base); each
                     step changes the adapters and moments, never the base
      ckpt full          Checkpointer(keep_last=2, staging_budget_bytes=0)
                         .save(blocking=True): every byte written, from the tensors
      ckpt incremental   Checkpointer(incremental=True, keep_last=2): unchanged entries
                         borrow the previous step's bytes
      DCP                torch.distributed.checkpoint.save (FileSystemWriter, 2 threads,
                         no process group), the two newest steps kept
  embedding rows     a large fp32 embedding table (`--emb-gib`, default 1 GiB, 1024 wide)
                     plus a dense 4 MiB head; each step changes `--emb-rows` random rows
                     of the table (a sparse update: the rows one batch touched) and all of
                     the head. Only the hash blocks holding a changed row differ, and an
                     incremental save writes only those (block references): full,
                     incremental and DCP as above
  all changed        the LoRA tensors, every one changed each step (dense training):
      ckpt full / ckpt incremental on it: the cost of looking for unchanged bytes when
      there are none (target: incremental / full save time close to 1)

Every save is durable (fsync) and verify="full" (the ckpt default: re-read cold, every
block checked). Bytes written are counted where they reach storage
(ckptd.storage.counters) for ckpt; DCP writes through its own files, so its figure is the
size of the files it made (plus its metadata). Each job gets one untimed first save (the
steady state is "saved every step"). Results: bench/results/incremental-<stamp>.json.

    .venv/bin/python bench/incremental.py [--base-gib 2] [--rank 16] [--emb-gib 1]
        [--emb-rows 64] [--reps 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

import ckpt  # noqa: E402
from ckptd import knobs  # noqa: E402
from ckptd.storage import counters  # noqa: E402


def lora_state(base_gib: float, rank: int, seed: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """{"base": {name: bf16}, "lora": {name: {A, B}}, "optim": {name: {exp_avg, exp_avg_sq}}}"""
    target = base_gib * (1 << 30) / 2  # parameters (bf16)
    best = min(
        range(64, 16384 + 1, 64),
        key=lambda h: abs(
            sum(t.numel() for t in _meta(C.transformer_shapes(h, 16, 32000))) - target
        ),
    )
    shapes = C.transformer_shapes(best, 16, 32000)
    g = torch.Generator().manual_seed(seed)
    base = {n: torch.randn(s, generator=g, dtype=torch.bfloat16) for n, s in shapes.items()}
    lora: dict[str, dict[str, torch.Tensor]] = {}
    optim: dict[str, dict[str, torch.Tensor]] = {}
    for n, s in shapes.items():
        if ".attn." not in n:
            continue
        a = torch.randn(rank, s[1], generator=g) * 0.01
        b = torch.zeros(s[0], rank)
        lora[n] = {"A": a, "B": b}
        for k, t in (("A", a), ("B", b)):
            optim[f"{n}/{k}"] = {"exp_avg": torch.zeros_like(t), "exp_avg_sq": torch.zeros_like(t)}
    state = {"base": base, "lora": lora, "optim": optim}
    base_bytes = sum(t.numel() * 2 for t in base.values())
    total = sum(t.numel() * t.element_size() for _, t in C.flat_tensors(state))
    desc = {
        "hidden": best,
        "tensors": len(C.flat_tensors(state)),
        "base_bytes": base_bytes,
        "trainable_bytes": total - base_bytes,
        "trainable_share": (total - base_bytes) / total,
    }
    return state, desc


EMB_DIM = 1024


def emb_state(gib: float, seed: int) -> dict[str, Any]:
    """{"emb": {"weight": fp32 [rows, 1024]}, "head": {"weight": fp32 [1024, 1024]}}"""
    rows = max(1, int(gib * (1 << 30)) // (EMB_DIM * 4))
    g = torch.Generator().manual_seed(seed + 1)
    return {
        "emb": {"weight": torch.randn(rows, EMB_DIM, generator=g)},
        "head": {"weight": torch.randn(EMB_DIM, EMB_DIM, generator=g)},
    }


def emb_step(state: dict[str, Any], rows: int, g: torch.Generator) -> tuple[int, int]:
    """One sparse step: `rows` random rows of the table and the whole head change; returns
    how many hash blocks of the table hold a changed row, and their bytes."""
    w = state["emb"]["weight"]
    idx = torch.randint(0, w.shape[0], (rows,), generator=g)
    w[idx] += 1e-3
    state["head"]["weight"].add_(1e-3)
    block, size = ckpt_block_size(), w.numel() * 4
    blocks = {int(r) * EMB_DIM * 4 // block for r in idx}
    return len(blocks), sum(min(block, size - k * block) for k in blocks)


def ckpt_block_size() -> int:
    return knobs.get().block_size


def _clone(tree: Any) -> Any:
    if isinstance(tree, dict):
        return {k: _clone(v) for k, v in tree.items()}
    return tree.clone()


def _meta(shapes: dict[str, tuple[int, ...]]) -> list[torch.Tensor]:
    return [torch.empty(s, device="meta") for s in shapes.values()]


def train_step(state: dict[str, Any], everything: bool) -> None:
    """What one optimizer step changes: the adapters and their moments (and, for a dense
    run, every tensor)."""
    for _, t in C.flat_tensors(state["lora"]) + C.flat_tensors(state["optim"]):
        t.add_(1e-3)
    if everything:
        for t in state["base"].values():
            t.add_(1)


class Bench:
    def __init__(
        self, work: Path, lora: dict[str, Any], dense: dict[str, Any], emb: dict[str, Any]
    ):
        self.work, self.lora, self.dense, self.emb = work, lora, dense, emb
        self.step = 1
        self.nbytes = sum(t.numel() * t.element_size() for _, t in C.flat_tensors(lora))
        self.size = self.nbytes
        self.desc: dict[str, Any] = {}
        self.notes: dict[str, Any] = {}
        self.written: dict[str, list[int]] = {}
        # Blocking saves written straight from the tensors (no staging copy), as DCP
        # writes: the same work for every method, and no host image per job.
        opts: dict[str, Any] = {"keep_last": 2, "staging_budget_bytes": 0}
        self.cps = {
            "ckpt full (LoRA)": ckpt.Checkpointer(work / "full", **opts),
            "ckpt incremental (LoRA)": ckpt.Checkpointer(work / "incr", incremental=True, **opts),
            "ckpt full (all changed)": ckpt.Checkpointer(work / "dense-full", **opts),
            "ckpt incremental (all changed)": ckpt.Checkpointer(
                work / "dense-incr", incremental=True, **opts
            ),
            "ckpt full (emb)": ckpt.Checkpointer(work / "emb-full", **opts),
            "ckpt incremental (emb)": ckpt.Checkpointer(
                work / "emb-incr", incremental=True, **opts
            ),
        }
        self.dcp_dirs: dict[str, list[Path]] = {}
        self.changed_blocks: list[tuple[int, int]] = []  # of the table, per step: n, bytes

    def state_of(self, name: str) -> dict[str, Any]:
        if "(emb)" in name:
            return self.emb
        return self.dense if "all changed" in name else self.lora

    def save(self, name: str) -> float:
        cp = self.cps[name]
        before = counters.snapshot()
        t0 = time.perf_counter()
        r = cp.save(self.state_of(name), self.step, blocking=True).wait()
        s = time.perf_counter() - t0
        assert r is not None
        self.written.setdefault(name, []).append((counters.snapshot() - before).written_bytes)
        return s

    def dcp(self, name: str) -> float:
        import torch.distributed.checkpoint as dcp

        path = self.work / f"dcp-{'emb' if '(emb)' in name else 'lora'}" / f"step-{self.step}"
        t0 = time.perf_counter()
        writer = dcp.FileSystemWriter(str(path), thread_count=2)  # sync_files=True by default
        dcp.save(self.state_of(name), storage_writer=writer, no_dist=True)
        C.fsync_tree(path)
        s = time.perf_counter() - t0
        self.written.setdefault(name, []).append(
            sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        )
        dirs = self.dcp_dirs.setdefault(name, [])
        dirs.append(path)
        while len(dirs) > 2:  # keep the two newest, as keep_last=2 does
            C.remove(dirs.pop(0))
        return s

    def close(self) -> None:
        for cp in self.cps.values():
            cp.close()


def lookup_cost(b: Bench, n: int = 5) -> list[float]:
    """The work an incremental save does that a full one does not, alone: reading its
    base's index (incremental.borrowable) and matching every entry against it."""
    from ckptd.format import checkpoint as ckfmt
    from ckptd.format import incremental as incr
    from ckptd.format.manifest import IndexEntry

    cp = b.cps.get("ckpt incremental (all changed)")
    if cp is None:
        return []
    base = ckfmt.latest_step(cp.storage)
    flat = C.flat_tensors(b.dense)
    items = [
        IndexEntry(
            k,
            str(t.dtype).removeprefix("torch."),
            list(t.shape),
            [0] * t.dim(),
            list(t.shape),
            0,
            0,
            [],
        )
        for k, t in flat
    ]
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        got = incr.borrowable(cp.storage, base, 0)
        for it in items:
            got.get(incr.borrow_key(it))
        out.append(time.perf_counter() - t0)
    return out


def registry(b: Bench) -> C.Registry:
    reg: C.Registry = []
    for name in ("ckpt full (LoRA)", "ckpt incremental (LoRA)"):
        reg.append(("LoRA", name, lambda _b, n=name: b.save(n)))
    reg.append(("LoRA", "DCP (LoRA)", lambda _b: b.dcp("DCP (LoRA)")))
    for name in ("ckpt full (emb)", "ckpt incremental (emb)"):
        reg.append(("embedding rows", name, lambda _b, n=name: b.save(n)))
    reg.append(("embedding rows", "DCP (emb)", lambda _b: b.dcp("DCP (emb)")))
    for name in ("ckpt full (all changed)", "ckpt incremental (all changed)"):
        reg.append(("all changed", name, lambda _b, n=name: b.save(n)))
    return reg


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--base-gib", type=float, default=2.0, help="frozen base size (default 2)")
    p.add_argument("--rank", type=int, default=16, help="LoRA rank (default 16)")
    p.add_argument("--emb-gib", type=float, default=1.0, help="embedding table (default 1)")
    p.add_argument("--emb-rows", type=int, default=64, help="rows changed a step (default 64)")
    p.add_argument("--reps", type=int, default=5, help="repetitions = steps (default 5)")
    p.add_argument("--dir", type=Path, default=C.RESULTS_DIR / "tmp-data", help="work directory")
    p.add_argument("--only", default="", help="|-separated substrings of method names")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore", module="torch.distributed")
    args.dir.mkdir(parents=True, exist_ok=True)
    work = args.dir / f"incremental-{os.getpid()}"
    work.mkdir()
    load = C.loadavg_at_start()
    lora, desc = lora_state(args.base_gib, args.rank, args.seed)
    dense = _clone(lora)
    emb = emb_state(args.emb_gib, args.seed)
    b = Bench(work, lora, dense, emb)
    desc["emb_bytes"] = sum(t.numel() * 4 for _, t in C.flat_tensors(emb))
    desc["emb_rows_per_step"] = args.emb_rows
    b.desc = desc
    g_rows = torch.Generator().manual_seed(args.seed + 2)
    print(
        f"state: {desc['tensors']} tensors, {b.nbytes / C.GB:.3f} GB: base "
        f"{desc['base_bytes'] / C.GB:.3f} GB frozen (hidden {desc['hidden']}), trainable "
        f"{desc['trainable_bytes'] / C.GB:.4f} GB ({100 * desc['trainable_share']:.1f}%, "
        f"rank {args.rank} + Adam moments); work dir {work}",
        flush=True,
    )
    reg = registry(b)
    C.select(reg, args.only)
    try:
        # The steady state: each job holds one save already (the base written once).
        for name in b.cps:
            if any(n == name for _, n, _ in reg):
                b.save(name)
        b.written.clear()
        b.step += 1

        def next_step() -> None:
            train_step(b.lora, everything=False)
            train_step(b.dense, everything=True)
            b.changed_blocks.append(emb_step(b.emb, args.emb_rows, g_rows))
            b.step += 1

        train_step(b.lora, everything=False)
        train_step(b.dense, everything=True)
        b.changed_blocks.append(emb_step(b.emb, args.emb_rows, g_rows))
        times, errors = C.run_reps(reg, b, args.reps, after_rep=next_step)
        b.notes["base_lookup_s"] = lookup_cost(b)
        b.notes["loadavg_start"], b.notes["loadavg_end"] = load, os.getloadavg()
        b.notes["written_bytes_per_save"] = b.written
        b.notes["emb_changed_blocks_per_step"] = [n for n, _ in b.changed_blocks[: args.reps]]
        b.notes["emb_changed_bytes_per_step"] = [n for _, n in b.changed_blocks[: args.reps]]
        b.notes["block_size"] = ckpt_block_size()
        report(b, reg, times, errors, args)
    finally:
        b.close()
        C.remove(work)
    return 0


def report(b: Bench, reg: C.Registry, times: dict, errors: dict, args: Any) -> None:
    med = {n: statistics.median(ts) for n, ts in times.items() if ts}
    wrote = {n: statistics.median(ws) for n, ws in b.written.items() if ws}
    print(
        f"\n{b.desc['tensors']} tensors, {b.nbytes / C.GB:.3f} GB per save; GB = 1e9 bytes; "
        f"{args.reps} steps, methods interleaved; load average {b.notes['loadavg_start'][0]:.1f}"
        f" at start, {b.notes['loadavg_end'][0]:.1f} at end"
    )
    w = max(len(n) for _, n, _ in reg) + 2
    print(f"{'method':<{w}} {'med save s':>10} {'min-max s':>14} {'written/save':>14}  ok")
    group = None
    for g, n, _ in reg:
        if g != group:
            print(f"-- {g}")
            group = g
        ts = times.get(n, [])
        if not ts:
            print(f"{n:<{w}} {'ERROR':>10}")
            continue
        spread = f"{min(ts):.3f}-{max(ts):.3f}"
        print(
            f"{n:<{w}} {med[n]:10.3f} {spread:>14} {wrote[n] / C.GB:11.4f} GB  "
            f"{len(ts)}/{args.reps}"
        )
    rows = [
        (
            "incremental / full: bytes written (LoRA)",
            "ckpt incremental (LoRA)",
            "ckpt full (LoRA)",
            "bytes",
        ),
        (
            "incremental / full: save time (LoRA)",
            "ckpt incremental (LoRA)",
            "ckpt full (LoRA)",
            "time",
        ),
        (
            "incremental / DCP: bytes written (LoRA)",
            "ckpt incremental (LoRA)",
            "DCP (LoRA)",
            "bytes",
        ),
        ("incremental / DCP: save time (LoRA)", "ckpt incremental (LoRA)", "DCP (LoRA)", "time"),
        ("full / DCP: save time (LoRA)", "ckpt full (LoRA)", "DCP (LoRA)", "time"),
        (
            "incremental / full: bytes written (emb)",
            "ckpt incremental (emb)",
            "ckpt full (emb)",
            "bytes",
        ),
        (
            "incremental / full: save time (emb)",
            "ckpt incremental (emb)",
            "ckpt full (emb)",
            "time",
        ),
        ("incremental / DCP: bytes written (emb)", "ckpt incremental (emb)", "DCP (emb)", "bytes"),
        ("incremental / DCP: save time (emb)", "ckpt incremental (emb)", "DCP (emb)", "time"),
        ("full / DCP: save time (emb)", "ckpt full (emb)", "DCP (emb)", "time"),
        (
            "incremental / full: save time (all changed)",
            "ckpt incremental (all changed)",
            "ckpt full (all changed)",
            "time",
        ),
        (
            "incremental / full: bytes written (all changed)",
            "ckpt incremental (all changed)",
            "ckpt full (all changed)",
            "bytes",
        ),
    ]
    ratios = []
    print("\nratios (of medians; time ratios also as the median of each step's own ratio,")
    print("the two methods run back to back in one repetition: robust to a slow minute)")
    for label, num, den, kind in rows:
        src = wrote if kind == "bytes" else med
        if num in src and den in src and src[den]:
            r = src[num] / src[den]
            row: dict[str, Any] = {"ratio": label, "value": r}
            extra = ""
            if kind == "time" and len(times[num]) == len(times[den]):
                pairs = [a / b for a, b in zip(times[num], times[den], strict=True)]
                row["paired_median"] = statistics.median(pairs)
                row["paired_min_max"] = (min(pairs), max(pairs))
                extra = f"   paired {row['paired_median']:.4f} ({min(pairs):.2f}-{max(pairs):.2f})"
            ratios.append(row)
            print(f"  {label:<52} {r:8.4f}{extra}")
    blocks = b.notes.get("emb_changed_blocks_per_step") or []
    changed = b.notes.get("emb_changed_bytes_per_step") or []
    inc = b.written.get("ckpt incremental (emb)", [])
    if blocks and inc:
        head = EMB_DIM * EMB_DIM * 4
        exact = [w == n + head for w, n in zip(inc, changed, strict=False)]
        print(
            f"\nembedding: {args.emb_rows} rows a step changed {statistics.median(blocks):.0f} "
            f"of the table's {(b.desc['emb_bytes'] - head) // b.notes['block_size']} blocks "
            f"(median); an incremental "
            f"save wrote exactly those blocks plus the head in {sum(exact)} of {len(exact)} steps"
        )
    look = b.notes.get("base_lookup_s")
    if look:
        print(
            f"\nwhat an incremental save adds (finding its base's entries: one index read "
            f"and the matching, median of {len(look)}): {statistics.median(look) * 1e3:.1f} ms"
        )
    result = {
        "bench": "incremental",
        "units": "GB = 1e9 bytes; seconds wall clock",
        "args": vars(args),
        "machine": C.machine_info(b.work),
        "state": b.desc,
        "notes": b.notes,
        "order": [n for _, n, _ in reg],
        "per_rep_seconds": times,
        "median_seconds": med,
        "median_written_bytes": wrote,
        "ratios": ratios,
        "errors": errors,
    }
    print(f"\nresults: {C.write_results('incremental', result)}")


if __name__ == "__main__":
    sys.exit(main())
