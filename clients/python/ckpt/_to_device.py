"""A load's verified bytes streamed into device (CUDA) tensors as they are hashed.

Staging a CUDA target whole in host memory and copying it after the last read cost a load
half its pace (a 10 GB load on an H200, 2026-12-04: 1.08 GB/s against a 2.06 GB/s cold
read of the same files): the staging memory had to be faulted in, every byte crossed to the
device only after all were read, and torch would keep pinned staging of that size for the
rest of the process. Here the reader hands each verified block (ckptd.format.boxes's
ByteDest) to `DeviceWrites.write`, on its hash thread, while later reads go on: the block
is copied into a slot of a small pinned ring and sent with an asynchronous copy on a side
stream, and the slot is reused once that copy's event has passed. A ring of 0 bytes copies
each block straight from the reader's pageable buffer instead (a blocking copy on the side
stream). `finish` waits for every copy; only then are the tensors the caller's again.
`DeviceLoads` makes the one choice of which targets take this path, for ckpt's loads and
for DCP's through ckptd's reader (ckpt.integrations.dcp).

The H200 run after this (2026-12-04, bench/README.md, gpu.py): 1.58 GB/s against a 1.91
GB/s cold read (0.83, from 0.52); 1.51 without the ring.

Only verified bytes reach the device, as with a load into CPU tensors in place: a load that
fails may leave verified bytes of its step in the targets, never a byte of a corrupt block.
"""

from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ckpt._flatten import flat_view, takes_stored_bytes
from ckptd import knobs
from ckptd.format.boxes import contiguous_box
from ckptd.format.checkpoint import OpenCheckpoint


def streams_to(t: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether a load target takes its stored bytes of `dtype` streamed to its device."""
    return t.device.type == "cuda" and takes_stored_bytes(t, dtype)


class DeviceLoads:
    """The device copies of one load (ckpt._restore's, or a DCP read through ckptd's
    reader): which targets take their bytes streamed, and the wait for all of them."""

    def __init__(self) -> None:
        self._writes: dict[torch.device, DeviceWrites] = {}

    def dest(
        self,
        ck: OpenCheckpoint,
        key: str,
        t: torch.Tensor,
        dtype: torch.dtype,
        offsets: Sequence[int],
        sizes: Sequence[int],
    ) -> _Dest | None:
        """The ByteDest of the box [offsets, offsets+sizes) of saved `key` in target `t`
        (shaped like the box) when `t` takes it streamed; None: stage it on the host (not a
        device tensor of the saved dtype, or a box saved chunks fill in strided runs)."""
        if not (streams_to(t, dtype) and contiguous_box(ck, key, offsets, sizes)):
            return None
        t = t.detach()
        writes = self._writes.get(t.device)
        if writes is None:
            writes = self._writes[t.device] = DeviceWrites(t.device)
        return writes.dest(t)

    def finish(self) -> None:
        """Wait for every copy (call it once the reads have ended, failed or not)."""
        for writes in self._writes.values():
            writes.finish()


class _Dest:
    """One target's bytes on its device (a ckptd.format.boxes.ByteDest)."""

    def __init__(self, writes: DeviceWrites, t: torch.Tensor):
        self._writes = writes
        self._bytes = flat_view(t.detach()).view(torch.uint8)
        self.nbytes = self._bytes.numel()

    def write(self, at: int, data: np.ndarray) -> None:
        self._writes.write(self._bytes[at : at + data.nbytes], data)


class DeviceWrites:
    """The copies of one load to one device. write() is called from several hash threads
    at once; finish() once every read has ended, failed or not."""

    def __init__(self, device: torch.device):
        k = knobs.get()
        cuda = device.type == "cuda"
        self._stream = torch.cuda.Stream(device) if cuda else None
        if self._stream is not None:
            # Work queued on the targets before the load (their allocation, a zero_())
            # comes first: the copies run on a stream of their own.
            self._stream.wait_stream(torch.cuda.current_stream(device))
        self._slot = max(1, k.device_load_slot)
        self._slots = k.device_load_ring // self._slot if k.device_load_ring > 0 else 0
        self._pin = cuda
        self._cond = threading.Condition()
        self._free: list[torch.Tensor] = []
        self._made = 0
        # (event, slot) of the copies sent, oldest first: a slot is free once its event passed.
        self._flying: collections.deque[tuple[Any, torch.Tensor]] = collections.deque()
        self.copied = 0

    def dest(self, t: torch.Tensor) -> _Dest:
        return _Dest(self, t)

    def write(self, dst: torch.Tensor, data: np.ndarray) -> None:
        """Copy verified host bytes `data` into `dst` (uint8 on the device); `data` may be
        reused as soon as this returns."""
        if not self._slots:
            src = torch.from_numpy(data if data.flags.writeable else data.copy())
            with self._on_stream():
                dst.copy_(src)  # pageable: blocking, the bytes are on the device after it
        else:
            for s in range(0, data.nbytes, self._slot):
                piece = data[s : s + self._slot]
                slot = self._take()
                try:
                    slot[: piece.nbytes].numpy()[:] = piece
                    with self._on_stream():
                        dst[s : s + piece.nbytes].copy_(slot[: piece.nbytes], non_blocking=True)
                        event = self._event()
                except BaseException:
                    self._give(slot)
                    raise
                with self._cond:
                    self._flying.append((event, slot))
                    self._cond.notify()
        with self._cond:
            self.copied += data.nbytes

    def finish(self) -> None:
        """Wait for every copy sent (the targets then hold every byte written)."""
        if self._stream is not None:
            self._stream.synchronize()
        with self._cond:
            self._free.extend(slot for _, slot in self._flying)
            self._flying.clear()

    # -- the ring ------------------------------------------------------------------
    def _on_stream(self) -> Any:
        if self._stream is None:
            return contextlib.nullcontext()
        return torch.cuda.stream(self._stream)

    def _event(self) -> Any:
        if self._stream is None:
            return None
        event = torch.cuda.Event()
        event.record(self._stream)
        return event

    def _take(self) -> torch.Tensor:
        """A free slot: a new one while the ring has room, else the oldest sent one, once
        its copy is done (waiting while every slot is being filled)."""
        while True:
            with self._cond:
                if self._free:
                    return self._free.pop()
                if self._made < self._slots:
                    self._made += 1
                    break
                if self._flying:
                    event, slot = self._flying.popleft()
                else:
                    self._cond.wait()
                    continue
            if event is not None:
                event.synchronize()  # outside the lock: other threads go on filling slots
            return slot
        try:
            return torch.empty(self._slot, dtype=torch.uint8, pin_memory=self._pin)
        except BaseException:
            with self._cond:
                self._made -= 1
                self._cond.notify()
            raise

    def _give(self, slot: torch.Tensor) -> None:
        with self._cond:
            self._free.append(slot)
            self._cond.notify()
