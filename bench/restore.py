"""Restore throughput of ckpt against the cold-read floor and its peers, resharding included.

One run prepares, untimed: the raw state as one file, torch.save / safetensors / DCP
copies, ckpt checkpoints saved by 1 process, and saved as 2 ranks' shards (every tensor
split on dim 0, as a 2-rank Shard(0) save writes it); a separate copy for each method, so
that every file is read once per repetition. Then, inside every repetition
(methods interleaved, each repetition starting one method later, so a slow period of
the disk hits all of them; caches dropped before each), it measures:
  limit   raw cold read, O_DIRECT, 2 and 4 threads (the floor)
  peer    DCP load; torch.load(mmap=True) + copy; safetensors safe_open + copy
  ckpt    ckpt.load at the same world size (1 -> 1, and 2 -> 2 as two simulated ranks);
          resharded: saved at 2, loaded at 1 (ckpt.load of the 2-shard checkpoint: two
          row blocks per tensor); saved at 1, loaded at 2 (two simulated ranks in two
          threads of this process, each reading its half of every tensor's rows through
          ckptd.format.boxes, the layer ckpt.load uses for a DTensor shard)
and prints median GB/s (GB = 1e9 bytes) with the min-max spread, then the ratios against
the targets: same-world load >= 0.8x the best raw O_DIRECT cold read and >= 2x DCP load;
each resharded load >= 0.7x the same-world load with as many readers (2 -> 1 against
1 -> 1, 1 -> 2 against 2 -> 2). Every load is checked bit for bit.
Results go to bench/results/restore-<timestamp>.json.

    .venv/bin/python bench/restore.py [--size-gib 2] [--reps 3]
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import _common as C
import numpy as np
import torch

READ_WINDOW = 16 * C.MiB
O_DIRECT = getattr(os, "O_DIRECT", 0)


@dataclass
class Bench:
    work: Path
    state: dict[str, Any]
    desc: dict[str, Any]
    flat: list[tuple[str, torch.Tensor]] = field(init=False)
    nbytes: int = field(init=False)
    image: np.ndarray = field(init=False)  # page-aligned destination memory
    dst: dict[str, Any] = field(init=False)  # the destination state (views into image)
    dst_flat: dict[str, torch.Tensor] = field(init=False)
    size: int = field(init=False)
    paths: dict[str, Path] = field(default_factory=dict)
    notes: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.flat = C.flat_tensors(self.state)
        self.nbytes = sum(t.nbytes for _, t in self.flat)
        pos, offsets = 0, []
        for _, t in self.flat:
            offsets.append(pos)
            pos = -(-(pos + t.nbytes) // C.ALIGN) * C.ALIGN
        self.size = pos
        self.image = C.aligned_buffer(self.size)
        self.dst_flat = {
            k: torch.frombuffer(self.image, dtype=t.dtype, count=t.numel(), offset=off).view(
                t.shape
            )
            for (k, t), off in zip(self.flat, offsets, strict=True)
        }
        self.dst = {"model": {}, "optim": {}}
        for k, t in self.dst_flat.items():
            group, name, *moment = k.split("/")
            if moment:
                self.dst[group].setdefault(name, {})[moment[0]] = t
            else:
                self.dst[group][name] = t

    def poison(self) -> None:
        self.image.fill(0x5A)

    def check(self) -> None:
        for k, t in self.flat:
            if not np.array_equal(C.u8(self.dst_flat[k]), C.u8(t)):
                raise AssertionError(f"{k}: loaded bytes differ from the saved state")


class Clock:
    def __init__(self, b: Bench):
        self.b = b
        self.s = 0.0

    def __enter__(self) -> Clock:
        self.b.notes["cache_drop"] = C.drop_caches(self.b.work)
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.s = time.perf_counter() - self.t0


Method = Callable[[Bench], float]
REGISTRY: list[tuple[str, str, Method]] = []


def method(group: str, name: str) -> Callable[[Method], Method]:
    def register(fn: Method) -> Method:
        REGISTRY.append((group, name, fn))
        return fn

    return register


# -- preparation (untimed) ------------------------------------------------------------------
def rows(t: torch.Tensor, parts: int) -> list[tuple[int, int]]:
    """Row blocks of a dim-0 split into `parts`, as torch's Shard(0) cuts them."""
    n = t.shape[0]
    step = -(-n // parts)
    return [(a, min(n, a + step)) for a in range(0, n, step)]


def save_as_ranks(b: Bench, job: Path, ranks: int) -> None:
    """Write the state as `ranks` ranks' shards, each tensor split on dim 0."""
    from ckptd import knobs
    from ckptd.format import checkpoint as ckfmt
    from ckptd.format import dtypes
    from ckptd.format.manifest import Manifest
    from ckptd.format.writer import WriteItem, write_shard
    from ckptd.storage import open_storage

    storage = open_storage(str(job), create=True)
    ckfmt.begin_step(storage, 1)
    items: list[list[WriteItem]] = [[] for _ in range(ranks)]
    for key, t in b.flat:
        for r, (lo, hi) in enumerate(rows(t, ranks)):
            part = t[lo:hi]
            offs = [lo] + [0] * (t.dim() - 1)
            items[r].append(
                WriteItem(
                    key, dtypes.name_of(t.dtype), list(t.shape), offs, list(part.shape), C.u8(part)
                )
            )
    shards = [
        write_shard(
            storage, job=str(job), step=1, rank=r, world_size=ranks, generation=0, items=items[r]
        )
        for r in range(ranks)
    ]

    def node(tree: Any, prefix: str) -> Any:
        if isinstance(tree, torch.Tensor):
            return {"tensor": prefix}
        return {"dict": [[k, node(v, f"{prefix}/{k}" if prefix else k)] for k, v in tree.items()]}

    k = knobs.get()
    m = Manifest(
        job=str(job),
        step=1,
        generation=0,
        world_size=ranks,
        block_size=k.block_size,
        alignment=k.alignment,
        shards=shards,
        state=node(b.state, ""),
    )
    ckfmt.commit(storage, m)


def prepare(b: Bench) -> None:
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    import ckpt

    t0 = time.perf_counter()
    raw = b.work / "raw.bin"
    fd = os.open(raw, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | O_DIRECT, 0o644)
    try:
        for key, t in b.flat:  # pack the tensors like the destination image, then write it
            b.dst_flat[key].copy_(t)
        done = 0
        while done < b.size:
            n = min(64 * C.MiB, b.size - done)
            done += os.pwrite(fd, b.image[done : done + n], done)
        os.fsync(fd)
    finally:
        os.close(fd)
    b.paths["raw"] = raw
    b.paths["torch"] = b.work / "torch.pt"
    torch.save(b.state, b.paths["torch"])
    b.paths["safetensors"] = b.work / "model.safetensors"
    save_file(dict(b.flat), str(b.paths["safetensors"]))
    b.paths["dcp"] = b.work / "dcp"
    dcp.save(b.state, storage_writer=dcp.FileSystemWriter(b.paths["dcp"]), no_dist=True)
    # One copy per method that reads it: every file is read once per repetition, so a cache
    # below the guest (a VM's host page cache survives drop_caches) favours no method.
    for name in ("ckpt1", "ckpt1b"):
        b.paths[name] = b.work / name
        ckpt.save(b.state, b.paths[name], step=1, verify="size")
    for name in ("ckpt2", "ckpt2b"):
        b.paths[name] = b.work / name
        save_as_ranks(b, b.paths[name], 2)
    C.fsync_tree(b.work)
    b.notes["prepare_s"] = time.perf_counter() - t0


# -- limits ---------------------------------------------------------------------------------
def raw_read(b: Bench, threads: int) -> float:
    """Cold positional O_DIRECT reads of the raw file, 16 MiB windows, per-thread buffers."""
    local = threading.local()

    def read(off: int) -> None:
        buf = getattr(local, "buf", None)
        if buf is None:
            buf = local.buf = C.aligned_buffer(READ_WINDOW)
        n = min(READ_WINDOW, b.size - off)
        if os.preadv(fd, [buf[: -(-n // C.ALIGN) * C.ALIGN]], off) < n:
            raise OSError(f"short read at {off}")

    with ThreadPoolExecutor(threads) as pool:
        pool.submit(lambda: None).result()  # threads started outside the clock
        with Clock(b) as clk:
            fd = os.open(b.paths["raw"], os.O_RDONLY | O_DIRECT)
            try:
                list(pool.map(read, range(0, b.size, READ_WINDOW)))
            finally:
                os.close(fd)
    return clk.s


method("limit", "raw cold read, O_DIRECT, 2 thr")(lambda b: raw_read(b, 2))
method("limit", "raw cold read, O_DIRECT, 4 thr")(lambda b: raw_read(b, 4))


# -- peers ----------------------------------------------------------------------------------
def copy_tree(src: Any, dst: Any) -> None:
    if isinstance(dst, torch.Tensor):
        dst.copy_(src)
        return
    for k, d in dst.items():
        copy_tree(src[k], d)


@method("peer", "DCP load")
def dcp_load(b: Bench) -> float:
    import torch.distributed.checkpoint as dcp

    b.poison()
    with Clock(b) as clk:
        dcp.load(b.dst, storage_reader=dcp.FileSystemReader(b.paths["dcp"]), no_dist=True)
    b.check()
    return clk.s


@method("peer", "torch.load(mmap) + copy")
def torch_load(b: Bench) -> float:
    b.poison()
    with Clock(b) as clk:
        loaded = torch.load(b.paths["torch"], mmap=True, weights_only=True)
        copy_tree(loaded, b.dst)
    del loaded
    b.check()
    return clk.s


@method("peer", "safetensors safe_open + copy")
def st_load(b: Bench) -> float:
    from safetensors import safe_open

    b.poison()
    with Clock(b) as clk, safe_open(str(b.paths["safetensors"]), framework="pt") as f:
        for k in f.keys():
            b.dst_flat[k].copy_(f.get_tensor(k))
    b.check()
    return clk.s


# -- ckpt -----------------------------------------------------------------------------------
@method("ckpt", "ckpt load, same world size (1 -> 1)")
def ckpt_load(b: Bench) -> float:
    import ckpt

    b.poison()
    with Clock(b) as clk:
        ckpt.load(b.dst, b.paths["ckpt1"], step=1)
    b.check()
    return clk.s


@method("ckpt", "ckpt resharded load, saved at 2 -> loaded at 1")
def ckpt_load_2to1(b: Bench) -> float:
    import ckpt

    b.poison()
    with Clock(b) as clk:
        ckpt.load(b.dst, b.paths["ckpt2"], step=1)
    b.check()
    return clk.s


def two_ranks(b: Bench, job: Path) -> float:
    """Two simulated ranks (threads) loading Shard(0) halves of every tensor from `job`."""
    from ckptd.format import checkpoint as ckfmt
    from ckptd.format.boxes import BoxRead, read_boxes
    from ckptd.storage import open_storage

    def rank(r: int) -> None:
        # What rank r of 2 does in ckpt.load for Shard(0) DTensors: its row block of every
        # tensor, straight into its (contiguous) local shard.
        ck = ckfmt.open_checkpoint(open_storage(str(job)), 1)
        boxes = []
        for key, t in b.flat:
            blocks = rows(t, 2)
            if r >= len(blocks):
                continue
            lo, hi = blocks[r]
            dst = b.dst_flat[key][lo:hi]
            boxes.append(BoxRead(key, [lo] + [0] * (t.dim() - 1), list(dst.shape), C.u8(dst)))
        read_boxes(ck, boxes)

    b.poison()
    with ThreadPoolExecutor(2) as pool, Clock(b) as clk:
        list(pool.map(rank, range(2)))
    b.check()
    return clk.s


method("ckpt", "ckpt load, same world size (2 -> 2)")(lambda b: two_ranks(b, b.paths["ckpt2b"]))
method("ckpt", "ckpt resharded load, saved at 1 -> loaded at 2")(
    lambda b: two_ranks(b, b.paths["ckpt1b"])
)


# -- report ---------------------------------------------------------------------------------
def ratios(med: dict[str, float]) -> list[dict[str, Any]]:
    nan = float("nan")
    floor = max([med[n] for n in med if n.startswith("raw cold read")] or [nan])
    same = med.get("ckpt load, same world size (1 -> 1)", nan)
    rows_ = [
        ("ckpt load (same world) / best raw O_DIRECT cold read", same, floor, 0.8),
        ("ckpt load (same world) / DCP load", same, med.get("DCP load", nan), 2.0),
        (
            "ckpt load (same world) / torch.load(mmap)+copy (info)",
            same,
            med.get("torch.load(mmap) + copy", nan),
            None,
        ),
        (
            "ckpt load (same world) / safetensors+copy (info)",
            same,
            med.get("safetensors safe_open + copy", nan),
            None,
        ),
        (
            "ckpt resharded 2 -> 1 / same-world load (1 -> 1)",
            med.get("ckpt resharded load, saved at 2 -> loaded at 1", nan),
            same,
            0.7,
        ),
        (
            "ckpt resharded 1 -> 2 / same-world load (2 -> 2)",
            med.get("ckpt resharded load, saved at 1 -> loaded at 2", nan),
            med.get("ckpt load, same world size (2 -> 2)", nan),
            0.7,
        ),
        (
            "ckpt resharded 1 -> 2 / same-world load (1 -> 1) (info)",
            med.get("ckpt resharded load, saved at 1 -> loaded at 2", nan),
            same,
            None,
        ),
    ]
    return C.ratio_verdicts(rows_)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--size-gib", type=float, default=2.0, help="state size in GiB (default 2)")
    p.add_argument("--reps", type=int, default=3, help="repetitions (default 3)")
    p.add_argument("--dir", type=Path, default=C.RESULTS_DIR / "tmp-data", help="work directory")
    p.add_argument(
        "--only", default="", help="run only methods whose name contains one of these |-separated"
    )
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore", module="torch.distributed")
    C.select(REGISTRY, args.only)
    args.dir.mkdir(parents=True, exist_ok=True)
    work = args.dir / f"restore-{os.getpid()}"
    work.mkdir()
    load0 = C.loadavg_at_start()
    t0 = time.perf_counter()
    state, desc = C.make_state(args.size_gib, args.seed)
    b = Bench(work, state, desc)
    try:
        prepare(b)
        print(
            f"state: {desc['tensors']} tensors, {b.nbytes / C.GB:.3f} GB (largest tensor "
            f"{desc['largest_tensor_bytes'] / C.GB:.3f} GB); built and saved in "
            f"{time.perf_counter() - t0:.1f} s; work dir {work}",
            flush=True,
        )
        times, errors = C.run_reps(REGISTRY, b, args.reps, rotate=True)
        b.notes["loadavg_start"], b.notes["loadavg_end"] = load0, os.getloadavg()
        note = f", caches dropped ({b.notes.get('cache_drop')})"
        C.report_run("restore", b, REGISTRY, times, errors, args, ratios, note)
    finally:
        C.remove(work)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
