"""Staging: copy a rank's tensors into host memory laid out exactly like its shard file.

The buffer is page-aligned (mmap), allocated once and reused by every later save that
fits, so a save's blocking part is one memcpy into memory that is already mapped (about
7x faster than copying into fresh pages), and the writer then does a few large O_DIRECT
writes straight from it, with no bounce copy. Copies run on a few threads with the GIL
released (ctypes memmove). CUDA tensors are copied device-to-host into the same buffer,
registered as pinned memory, with non_blocking copies on a side stream, synchronised
before staging returns.

A fresh buffer costs far more than the copy: on the 2-core VM, copying 2 GiB into new
pages took 2.9 s (a page fault each) against 0.18 s into mapped ones, and mapping them up
front (MAP_POPULATE) 0.74 s. So the buffer is always mapped populated (with the GIL
released: ckptd.storage.local.map_populated), and `prepare` does it (and the CUDA registration) on a thread of its own as soon as the state's size
is known before the first save (Checkpointer.resume: a training loop resumes, then
trains, then saves), so the first save's blocking part is a copy like every later one.
A load alone (inference) maps nothing.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ckpt._flatten import Leaf, flatten
from ckptd import iopool, knobs
from ckptd.errors import CkptError
from ckptd.format.writer import WriteItem, plan_offsets
from ckptd.storage.local import map_populated

_HUGE = 2 << 20
_COPY_PIECE = 64 << 20
# Neighbouring small copies run as one task of at least this many bytes: a task each cost
# a future (an RLock and a Condition) and a hand-off, so 3,000 small tensors spent 15-45
# ms of a 170 ms stall on tasks; 4 MiB copies in about 1 ms, and the threads still finish
# within a task of each other (bench/README.md, twenty-seventh pass).
_COPY_GROUP = 4 << 20


class HostImage:
    """A reusable page-aligned host buffer; grows, never shrinks while in use."""

    def __init__(self) -> None:
        self._mm: mmap.mmap | None = None
        self._buf: np.ndarray | None = None
        self._pinned = False
        self._pin_device: int | None = None  # the CUDA device current when it was pinned
        self._pin_failed = False
        self._preparing: threading.Thread | None = None
        self.allocated_on: str | None = None  # the thread that mapped the buffer in use
        # Seconds callers have waited, in all, for a background preparation to finish: a
        # save that came before its buffer was mapped (SaveResult.image_wait_s).
        self.waited_s = 0.0

    @property
    def capacity(self) -> int:
        return 0 if self._buf is None else self._buf.nbytes

    def prepare(self, size: int, *, pin: bool = False) -> None:
        """Map (and fault in, and with `pin` register with CUDA) a buffer of at least
        `size` bytes on a background thread; the next ensure() waits for it."""
        self.wait_prepared()
        if self.capacity >= size and (self._pinned or self._pin_failed or not pin):
            return

        # The CUDA device is per host thread (a new thread starts on device 0): register
        # with the caller's, or every rank would open a context on GPU 0.
        device = torch.cuda.current_device() if pin and torch.cuda.is_available() else None

        def run() -> None:
            try:  # Linux nice is per thread: yield the cores to training and its I/O
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
            except (AttributeError, OSError):
                pass
            self.ensure(size)
            if pin:
                self.pin(device)

        self._preparing = threading.Thread(target=run, name="ckpt-staging-prepare", daemon=True)
        self._preparing.start()

    def wait_prepared(self) -> None:
        t = self._preparing
        if t is not None and t is not threading.current_thread():
            t0 = time.perf_counter()
            t.join()
            self.waited_s += time.perf_counter() - t0
            self._preparing = None

    def ensure(self, size: int) -> np.ndarray:
        self.wait_prepared()
        if self._buf is None or self._buf.nbytes < size:
            self.release()
            cap = max(_HUGE, -(-size // _HUGE) * _HUGE)
            self._mm, self._buf = map_populated(cap)
            self.allocated_on = threading.current_thread().name
        assert self._buf is not None
        return self._buf[:size]

    def pin(self, device: int | None = None) -> None:
        """Register the buffer with CUDA so device-to-host copies are DMA (once per buffer).

        device: the CUDA device to register with (default: the calling thread's current
        one). The call runs on a thread of its own: a failed cudaHostRegister stays in
        the CUDA runtime's per-thread last error (torch's binding does not clear it), and
        on the training thread the next kernel launch check would raise it."""
        if self._pinned or self._pin_failed or self._buf is None or not torch.cuda.is_available():
            return
        if device is None:
            device = torch.cuda.current_device()
        ptr, nbytes = int(self._buf.ctypes.data), self._buf.nbytes
        rc: list[int] = [-1]

        def register() -> None:
            with torch.cuda.device(device):
                # 1: cudaHostRegisterPortable, as torch.cuda._pin_memory_utils
                rc[0] = int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 1))

        t = threading.Thread(target=register, name="ckpt-staging-pin", daemon=True)
        t.start()
        t.join()
        self._pinned = rc[0] == 0
        self._pin_failed = not self._pinned  # not retried (seconds each) for this buffer
        self._pin_device = device if self._pinned else None

    def release(self) -> None:
        self.wait_prepared()
        if self._pinned and self._buf is not None:
            with torch.cuda.device(self._pin_device):
                torch.cuda.cudart().cudaHostUnregister(int(self._buf.ctypes.data))
        self._pinned = self._pin_failed = False
        self._pin_device = None
        self._buf = None
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:
                pass  # still referenced by a write in flight; freed when that ends
            self._mm = None


def prepare_for(image: HostImage, state: Any, *, rank: int, budget: int | None) -> None:
    """Map `image` for a later save of `state` in the background (Checkpointer.resume
    calls it: the state is known there, before the first save)."""
    try:
        _node, leaves = flatten(state, rank=rank, keep_device=True)
    except CkptError:
        return  # the save itself reports what it cannot save
    size = image_size(leaves, knobs.get().alignment, budget)
    if size:
        image.prepare(size, pin=any(leaf.on_device for leaf in leaves))


def image_size(leaves: Sequence[Leaf], alignment: int, budget: int | None) -> int:
    """The bytes of host image a save of `leaves` stages into (at most `budget`)."""
    sizes = [leaf.nbytes for leaf in leaves]
    offsets, size = plan_offsets(sizes, alignment)
    if budget is None or size <= budget:
        return size
    fit = [
        o + n
        for o, n in zip(offsets, sizes, strict=True)
        if -(-(o + n) // alignment) * alignment <= budget
    ]
    return -(-max(fit, default=0) // alignment) * alignment


def stage(
    leaves: Sequence[Leaf], image: HostImage, *, alignment: int = 4096, threads: int = 2
) -> tuple[np.ndarray, list[WriteItem], list[int]]:
    """Copy every leaf into `image` at its shard offset; returns (file image, items, offsets).

    The items' data are views into the image, so the caller may let training mutate the
    tensors as soon as this returns.
    """
    sizes = [leaf.nbytes for leaf in leaves]
    offsets, size = plan_offsets(sizes, alignment)
    if not size:  # nothing to copy (a budget of 0, or only empty tensors): map nothing
        empty = np.empty(0, dtype=np.uint8)
        return empty, [leaf.write_item(empty) for leaf in leaves], offsets
    buf = image.ensure(size)
    base = int(buf.ctypes.data)
    # Zero the padding between entries (the file's bytes there are zeros).
    for i, (off, n) in enumerate(zip(offsets, sizes, strict=True)):
        end = offsets[i + 1] if i + 1 < len(offsets) else size
        if end > off + n:
            ctypes.memset(base + off + n, 0, end - off - n)
    cuda = [i for i, leaf in enumerate(leaves) if leaf.on_device]
    if cuda:
        image.pin()
        _stage_cuda(leaves, cuda, buf, offsets)
    groups: list[list[tuple[int, int, int]]] = [[]]
    size_of_last = 0
    for i, leaf in enumerate(leaves):
        if i in cuda or not sizes[i]:
            continue
        src = int(leaf.data.ctypes.data)
        for start in range(0, sizes[i], _COPY_PIECE):
            n = min(_COPY_PIECE, sizes[i] - start)
            if size_of_last >= _COPY_GROUP:
                groups.append([])
                size_of_last = 0
            groups[-1].append((base + offsets[i] + start, src + start, n))
            size_of_last += n
    if len(groups) > 1 and threads > 1:
        list(iopool.executor(threads).map(_copy_all, groups))
    else:
        for group in groups:
            _copy_all(group)
    items = [
        leaf.write_item(buf[off : off + n])
        for leaf, off, n in zip(leaves, offsets, sizes, strict=True)
    ]
    return buf, items, offsets


def _copy_all(copies: list[tuple[int, int, int]]) -> None:
    for dst, src, n in copies:
        ctypes.memmove(dst, src, n)


def _stage_cuda(
    leaves: Sequence[Leaf], which: list[int], buf: np.ndarray, offsets: list[int]
) -> None:
    # A copy runs on the current stream of its tensor's device (Copy.cu sets the device
    # guard to the CUDA side): one side stream per device the leaves are on, each after
    # that device's current stream, and all of them synchronized before the host reads.
    by_device: dict[torch.device, list[int]] = {}
    for i in which:
        by_device.setdefault(leaves[i].source.device, []).append(i)
    streams = []
    for device, idx in by_device.items():  # only CUDA leaves are on a device (ckpt._flatten)
        stream = torch.cuda.Stream(device=device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for i in idx:
                t = leaves[i].source
                n = t.numel() * t.element_size()
                if not n:
                    continue
                dst = torch.from_numpy(buf[offsets[i] : offsets[i] + n])
                dst.view(t.dtype).view(t.shape).copy_(t, non_blocking=True)
        streams.append(stream)
    for stream in streams:
        stream.synchronize()
