"""Would a save that writes O_DIRECT straight from torch's own tensors beat the bounce copy?

A one-rank `ckpt.save` writes from the caller's tensors. Under O_DIRECT the memory of a
transfer must be aligned (this VM's virtio disk: `dma_alignment` 511), and torch's large
CPU tensors start 64 bytes past a page, while a packed shard (format version 2) puts every
entry at a 4 KiB-aligned offset. So each window is first copied into an aligned,
huge-page bounce buffer (ckptd.storage.local), and that copy is what separates the save
from the floor, which writes from a page-aligned image (bench/README.md, issue 16).

The way around it would be a format change: place each entry at the 4 KiB-aligned end of
the one before plus its memory's offset within a page ("phased"), so that file offset and
address agree modulo 4096 and the whole pages of every tensor go to the device straight
from its memory, with only each tensor's first and last partial pages (and the padding)
through the bounce buffer. This script measures that before anyone builds it: the same
bytes (bench/_common.make_state) written four ways, interleaved, each an fsynced file:

  bounce      the packed layout, every window copied into an aligned bounce buffer
  packed, ckptd's writer
              the packed layout as ckptd writes it (ckptd.storage.local.direct_segments):
              the whole pages of page-aligned tensors straight, the rest bounced; the same
              as `bounce` for torch's default allocation, not with THP_MEM_ALLOC_ENABLE=1
  phased      the phased layout through the same direct_segments
  image       the packed layout from a page-aligned huge-page image, no copy: the floor
              save_restore.py uses, reachable by a save that staged (Checkpointer.save)

Whether memory in 4 KiB pages costs the disk more than the copy depends on the kernel's
transparent huge pages (printed, with THP_MEM_ALLOC_ENABLE): run it under each.

with `--mode new` (a new file, as a save's first write) or `--mode overwrite` (the file's
blocks already allocated, as a recycled save). It checks the phased file's bytes before
timing, and prints median wall and CPU seconds (all threads) with the spread.

    .venv/bin/python bench/zero_copy_write.py [--mode new|overwrite] [--threads 4] [--reps 5]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import resource
import statistics
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import _common as C
import numpy as np

from ckptd.storage.local import direct_segments

WINDOW = 32 << 20  # ckptd's io_window
IOV_MAX = 1024

Window = tuple[int, int, list[tuple[int, np.ndarray]]]  # file offset, length, pieces


def _round_up(n: int, align: int) -> int:
    return -(-n // align) * align


def layout(src: list[np.ndarray], phased: bool) -> tuple[list[int], int]:
    """Each tensor's file offset and the file size: packed (4 KiB-aligned) or phased."""
    offsets, pos = [], 0
    for a in src:
        off = _round_up(pos, C.ALIGN) + (a.ctypes.data % C.ALIGN if phased else 0)
        offsets.append(off)
        pos = off + a.nbytes
    return offsets, _round_up(pos, C.ALIGN)


def windows(src: list[np.ndarray], offsets: list[int], size: int) -> list[Window]:
    out: list[Window] = []
    j = 0
    for start in range(0, size, WINDOW):
        end = min(size, start + WINDOW)
        while j < len(src) and offsets[j] + src[j].nbytes <= start:
            j += 1
        pieces, k = [], j
        while k < len(src) and offsets[k] < end:
            lo, hi = max(start, offsets[k]), min(end, offsets[k] + src[k].nbytes)
            if hi > lo:
                pieces.append((lo, src[k][lo - offsets[k] : hi - offsets[k]]))
            k += 1
        out.append((start, end - start, pieces))
    return out


class _Scratch(threading.local):
    buf: np.ndarray | None = None

    def get(self, n: int) -> np.ndarray:
        if self.buf is None or self.buf.nbytes < n:
            self.buf = C.aligned_buffer(n)
        return self.buf


_scratch = _Scratch()


def _fill(
    buf: np.ndarray, base: int, lo: int, hi: int, pieces: list[tuple[int, np.ndarray]]
) -> None:
    """File bytes [lo, hi) from the pieces (zeros between) into buf at lo - base."""
    pos = lo
    for off, arr in pieces:
        a, b = max(off, lo), min(off + arr.nbytes, hi)
        if b <= a:
            continue
        if a > pos:
            ctypes.memset(buf.ctypes.data + pos - base, 0, a - pos)
        ctypes.memmove(buf.ctypes.data + a - base, arr.ctypes.data + a - off, b - a)
        pos = b
    if hi > pos:
        ctypes.memset(buf.ctypes.data + pos - base, 0, hi - pos)


def write_bounce(fd: int, w: Window) -> None:
    off, n, pieces = w
    buf = _scratch.get(WINDOW)
    _fill(buf, off, off, off + n, pieces)
    if os.pwrite(fd, buf[:n], off) != n:
        raise OSError(f"short write at {off}")


def write_segments(fd: int, w: Window) -> None:
    """As ckptd writes a window (ckptd.storage.local.direct_segments): the whole pages of
    pieces whose memory is aligned like their file offset straight (64 KiB or more of
    them), the rest bounced."""
    off, n, pieces = w
    buf = _scratch.get(WINDOW)
    views = direct_segments(off, n, pieces, lambda k: buf[:k])
    done = 0
    for i in range(0, len(views), IOV_MAX):
        done += os.pwritev(fd, views[i : i + IOV_MAX], off + done)  # type: ignore[arg-type]
    if done != n:
        raise OSError(f"short write at {off}: {done} of {n}")


def _transparent_hugepages() -> str:
    """The kernel's THP mode: with "always" torch's tensors sit in huge pages, and a write
    straight from them goes in requests as large as from the bounce buffer."""
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "unknown"
    return text[text.find("[") + 1 : text.find("]")] if "[" in text else text.strip()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--size-gib", type=float, default=2.0)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=4, help="I/O threads (ckptd's io_threads: 4)")
    p.add_argument("--mode", choices=("new", "overwrite"), default="new")
    p.add_argument("--dir", default=str(C.RESULTS_DIR / "tmp-data"))
    args = p.parse_args(argv)

    state, desc = C.make_state(args.size_gib)
    src = [C.u8(t) for _, t in C.flat_tensors(state)]
    nbytes = sum(a.nbytes for a in src)
    packed, packed_size = layout(src, phased=False)
    phased, phased_size = layout(src, phased=True)
    image = C.aligned_buffer(packed_size)
    for o, a in zip(packed, src, strict=True):
        image[o : o + a.nbytes] = a

    def write_image(fd: int, w: Window) -> None:
        off, n, _ = w
        if os.pwrite(fd, image[off : off + n], off) != n:
            raise OSError(f"short write at {off}")

    work = Path(args.dir) / f"zero-copy-{os.getpid()}"
    work.mkdir(parents=True)
    Method = tuple[Callable[[int, Window], None], list[Window], int]
    methods: dict[str, Method] = {
        "bounce (packed, all copied)": (
            write_bounce,
            windows(src, packed, packed_size),
            packed_size,
        ),
        "packed, ckptd's writer": (write_segments, windows(src, packed, packed_size), packed_size),
        "phased, straight from the tensors": (
            write_segments,
            windows(src, phased, phased_size),
            phased_size,
        ),
        "image, no copy (the floor)": (write_image, windows(src, packed, packed_size), packed_size),
    }

    def run(name: str) -> tuple[float, float]:
        fn, ws, size = methods[name]
        path = work / f"{size}.bin"
        if args.mode == "new" and path.exists():
            path.unlink()
        if args.mode == "overwrite" and not path.exists():  # its blocks allocated, untimed
            with open(path, "wb") as f:
                for _ in range(0, size, WINDOW):
                    f.write(bytes(min(WINDOW, size - f.tell())))
                os.fsync(f.fileno())
        os.sync()
        flags = os.O_WRONLY | os.O_DIRECT
        flags |= os.O_CREAT | os.O_EXCL if args.mode == "new" else 0
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        clock = time.perf_counter()
        fd = os.open(path, flags, 0o644)
        try:
            if args.mode == "new":
                os.ftruncate(fd, size)
            with ThreadPoolExecutor(args.threads) as pool:
                list(pool.map(lambda w: fn(fd, w), ws))
            os.fsync(fd)
        finally:
            os.close(fd)
        wall = time.perf_counter() - clock
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        cpu = r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime
        return wall, cpu

    try:
        run("phased, straight from the tensors")  # then check what it wrote
        with open(work / f"{phased_size}.bin", "rb") as f:
            for off, a in zip(phased, src, strict=True):
                f.seek(off)
                if f.read(a.nbytes) != a.tobytes():
                    raise AssertionError(f"the phased file differs at byte {off}")
        results: dict[str, list[tuple[float, float]]] = {n: [] for n in methods}
        names = list(methods)
        for rep in range(args.reps):
            for name in (
                names[rep % len(names) :] + names[: rep % len(names)]
            ):  # rotated: no fixed neighbour
                results[name].append(run(name))
    finally:
        C.remove(work)

    thp = _transparent_hugepages()
    print(
        f"\ntransparent huge pages: {thp}; THP_MEM_ALLOC_ENABLE="
        f"{os.environ.get('THP_MEM_ALLOC_ENABLE', '(unset)')}"
    )
    print(
        f"{desc['tensors']} tensors, {nbytes / C.GB:.3f} GB, {args.mode} file, "
        f"{args.threads} threads x {WINDOW >> 20} MiB, {args.reps} reps interleaved; "
        f"the phased file is {phased_size - packed_size} bytes larger"
    )
    print(f"{'method':36s} {'wall s (median, min-max)':>28s} {'GB/s':>6s} {'CPU s':>6s}")
    table: dict[str, Any] = {}
    for name, got in results.items():
        walls, cpus = [w for w, _ in got], [c for _, c in got]
        med = statistics.median(walls)
        table[name] = {"wall_s": walls, "cpu_s": cpus, "median_gbps": nbytes / med / C.GB}
        print(
            f"{name:36s} {med:9.3f} ({min(walls):.3f}-{max(walls):.3f})      "
            f"{nbytes / med / C.GB:6.2f} {statistics.median(cpus):6.3f}"
        )
    out = C.write_results(
        "zero_copy_write",
        {
            "args": vars(args),
            "machine": C.machine_info(work.parent),
            "transparent_hugepages": thp,
            "thp_mem_alloc_enable": os.environ.get("THP_MEM_ALLOC_ENABLE"),
            "state": desc,
            **table,
        },
    )
    print(f"\nresults: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
