"""torch.distributed.checkpoint (DCP) through ckptd.

    import torch.distributed.checkpoint as dcp
    from ckpt.integrations.dcp import StorageReader, StorageWriter

    dcp.save(state_dict, storage_writer=StorageWriter("/ckpts/run42", step=100))
    dcp.async_save(state_dict, storage_writer=StorageWriter("/ckpts/run42", step=200))
    dcp.load(state_dict, storage_reader=StorageReader("/ckpts/run42"))  # newest step

DCP plans, deduplicates replicas and reshards; ckptd stores, hashes, verifies and commits.
The save, in DCP's call order:

    prepare_global_plan  (DCP's coordinator rank) opens the job with ckptd's coordinator
                         (the generation fences older launches), refuses a committed step,
                         and assigns every rank its shard file (plan.storage_data)
    write_data           (every rank) writes its items as one ckptd shard with ckptd's
                         writer: aligned, blake3 per block, fsync, index, cold re-read
                         verified; the block hashes, sizes and shard travel back to the
                         coordinator rank in WriteResult.storage_data. Bytes items (DCP's
                         non-tensor values) travel as JSON nodes, never pickled.
    finish               (coordinator rank) runs ckptd's commit protocol for every rank:
                         BeginSave with each rank's chunks and hashes, ReportShard (the
                         coordinator stats each shard, checks its index blake3 and that it
                         holds exactly the planned chunks), AwaitCommit. The manifest,
                         written last by the coordinator, is the commit point.

dcp.save(use_collectives=False): every rank commits its own part through the coordinator
(_dcp_alone); replicas every rank planned are written once, by the rank it assigns.

Several chunks of one key on one rank (a ShardedTensor with several local shards) are
several entries of that rank's shard, one per box; the coordinator checks that the boxes of
every key tile it, and the load reshards from them like any other chunks.

A step is never overwritten: a StorageWriter for a step the job has committed is refused
in prepare_global_plan, before any rank writes (save under a new step; retention with
keep_last removes old ones). DCP's FileSystemWriter(overwrite=True) has no counterpart.

Falling back to an older step: a StorageReader reads the one step it opened (DCP plans
against that step's Metadata before any byte is read, so a damaged block found in read_data
cannot be retried inside dcp.load). `load(state_dict, path)` runs dcp.load under ckpt's load
policy (ckpt._load, the one every ckpt load uses): the newest committed step in every
rank's view, and when a rank finds it damaged every rank moves to the next older one
together, the damaged step quarantined.

dcp_to_torch_save / torch_save_to_dcp are DCP's format_utils conversions with a ckptd job
in place of a DCP directory.

The result is an ordinary ckptd checkpoint (`ckpt.load`, `ckptctl verify/restore`); DCP's
Metadata is rebuilt from its JSON manifest by StorageReader.read_metadata (see
_dcp_manifest). The load reads each requested box through ckptd's reader, every block
verified before it reaches the state dict; a corrupt shard raises HashMismatch (inside
DCP's CheckpointException) naming job, step, rank, file and key.

Bytes items and pickle: DCP's own load planner turns every bytes item into a value with
torch.load(weights_only=False). ckptd never hands it bytes from storage: the value is
stored as JSON, decoded to a plain value, and serialized again in memory with torch.save
just before DCP reads it back, so what DCP unpickles was produced by this process from
None/bool/int/float/str/bytes/list/tuple/dict values. Values that are not plain (custom
objects, lambdas in a scheduler state) are refused at save time naming their fqn.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.checkpoint import StorageReader as _DCPReader
from torch.distributed.checkpoint import StorageWriter as _DCPWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
from torch.distributed.checkpoint.state_dict_loader import load as _dcp_load
from torch.distributed.checkpoint.state_dict_saver import _save_state_dict
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from ckpt import _world
from ckpt._flatten import readable_in_place, tensor_bytes
from ckpt._load import load_from_tiers
from ckpt._restore import LoadResult
from ckpt._results import check_metadata
from ckpt._to_device import DeviceLoads
from ckpt.integrations import _commit, _coordinator
from ckpt.integrations import _dcp_alone as _alone
from ckpt.integrations import _dcp_manifest as dm
from ckpt.integrations._plain import from_node, to_node
from ckptd.coordinator.planning import ChunkPlan
from ckptd.errors import CkptError, CorruptCheckpoint, PeerReadFailed, UnsupportedValue
from ckptd.format import checkpoint as ckfmt
from ckptd.format import dtypes, layout
from ckptd.format.boxes import BoxRead, read_boxes
from ckptd.format.manifest import ShardInfo
from ckptd.format.writer import WriteItem
from ckptd.storage import JobLocation, Storage, open_storage

__all__ = ["StorageReader", "StorageWriter", "dcp_to_torch_save", "load", "torch_save_to_dcp"]

log = logging.getLogger("ckpt")


@dataclasses.dataclass(frozen=True)
class _Written:
    """WriteResult.storage_data: where an item went, or its value as a JSON node."""

    rank: int
    shard: ShardInfo
    key: str | None = None  # tensor items: the entry key in the shard
    chunk: ChunkPlan | None = None  # its description and blake3 (of the block hashes)
    node: Any = None  # bytes items: the plain value as a JSON node
    bytes_io: bool = False


class StorageWriter(_DCPWriter):
    """Save a DCP state dict as step `step` of the ckptd job at `path`.

    verify: "full" (default) re-reads every shard cold and checks its blake3 before the
        commit; "size" checks sizes only (bytes are still hashed as written).
    keep_last: after the commit, keep only the newest N committed steps.
    metadata: user metadata (plain JSON) stored in the manifest beside the "dcp" section.
    coordinator / token: a `ckptd serve` address (default $CKPTD_ADDRESS / $CKPTD_TOKEN);
        without one, DCP's coordinator rank runs an embedded coordinator.
    attempt: names this launch (default: torchelastic's run id and restart count, or one
        id per process); a newer attempt fences saves of older ones.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        step: int,
        *,
        verify: str = "full",
        keep_last: int | None = None,
        metadata: dict[str, Any] | None = None,
        coordinator: str | None = None,
        token: str | None = None,
        attempt: str | None = None,
        timeout_s: float = 600.0,
        io_threads: int | None = None,
    ):
        super().__init__()
        if verify not in ("full", "size"):
            raise ValueError(f"verify must be 'full' or 'size', got {verify!r}")
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"keep_last must be at least 1, got {keep_last}")
        self.path = JobLocation.of(path).path
        self.step = layout.check_step(step)
        self.verify, self.keep_last = verify, keep_last
        self.metadata = check_metadata(metadata)
        if dm.SECTION in self.metadata:
            raise ValueError(f"metadata key {dm.SECTION!r} is reserved for DCP's own description")
        self.coordinator, self.token, self.attempt = coordinator, token, attempt
        self.timeout_s, self.io_threads = timeout_s, io_threads
        self.rank = 0
        self.alone = False  # dcp.save(use_collectives=False): each rank commits its part
        self._target: _commit.Target | None = None
        self._conn: _coordinator.Connection | None = None
        self._alone: _alone.RankPart | None = None

    @property
    def _where(self) -> str:
        return f"job {self.path!r} step {self.step} rank {self.rank}"

    # -- DCP's StorageWriter ------------------------------------------------------------
    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """A checkpoint_id passed to dcp.save names the job directory (the step stays)."""
        if checkpoint_id is not None:
            self.path = JobLocation.of(checkpoint_id).path
        self._target = None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.rank = int(kwargs.get("rank", _world.rank_and_world()[0]))
        self.alone = kwargs.get("use_collectives", True) is False

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=f"{self.path}/{layout.step_dir(self.step)}")

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False  # never chosen automatically: pass storage_writer=StorageWriter(...)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Open the job, refuse a committed step, give every rank its shard (coordinator rank)."""
        if self.alone:  # every rank, with its own plan only
            self._alone = _alone.RankPart.open(self)
            return [dataclasses.replace(plans[0], storage_data=self._alone.target)]
        conn = self._conn = _coordinator.connect(
            self.path, address=self.coordinator, token=self.token, attempt=self.attempt
        )
        _commit.begin_step(open_storage(self.path, create=True), self.path, self.step)
        self._target = _commit.Target(
            self.path, self.step, conn.generation, 0, len(plans), self.verify, self.io_threads
        )
        return [
            dataclasses.replace(p, storage_data=dataclasses.replace(self._target, rank=r))
            for r, p in enumerate(plans)
        ]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Write this rank's items as one verified ckptd shard (every rank)."""
        target = plan.storage_data
        if not isinstance(target, _commit.Target):
            raise CkptError(
                f"{self._where}: the plan carries no ckptd target; was prepare_global_plan skipped?"
            )
        self.rank = target.rank
        tensors: list[tuple[Any, WriteItem]] = []
        objects: list[tuple[Any, Any, bool]] = []
        for item in plan.items:
            fqn = item.index.fqn
            key = dm.key_of(dm.path_of(fqn, plan.planner_data))
            if item.type == WriteItemType.BYTE_IO:
                objects.append((item, *self._plain(planner, item)))
                continue
            tensors.append((item, _write_item(planner, item, key, self._where)))
        if self._alone is not None:
            version = getattr(getattr(planner, "metadata", None), "version", None)
            self._alone.write(plan.planner_data, tensors, objects, version)
            fut0: Future[list[WriteResult]] = Future()
            fut0.set_result([WriteResult(index=it.index, size_in_bytes=w.data.nbytes,
                                         storage_data=None) for it, w in tensors])  # fmt: skip
            return fut0
        info, chunks = _commit.write_shard(target, [w for _, w in tensors])
        results = [
            WriteResult(
                index=item.index,
                size_in_bytes=w.data.nbytes,
                storage_data=_Written(target.rank, info, w.key, chunk),
            )
            for (item, w), chunk in zip(tensors, chunks, strict=True)
        ]
        results += [
            WriteResult(
                index=item.index,
                size_in_bytes=0,
                storage_data=_Written(target.rank, info, node=node, bytes_io=bio),
            )
            for item, node, bio in objects
        ]
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def _plain(self, planner: SavePlanner, item: Any) -> tuple[Any, bool]:
        """A bytes item's value as a JSON node (from the object, never from DCP's pickle)."""
        fqn = item.index.fqn
        lookup: Callable[[Any], Any] | None = getattr(planner, "lookup_object", None)
        if lookup is None:
            raise UnsupportedValue(
                f"{self._where}: DCP fqn {fqn!r} is a non-tensor value and the save planner "
                f"{type(planner).__name__} has no lookup_object(); ckptd stores non-tensor "
                "values as JSON, not DCP's pickle: use DefaultSavePlanner or a subclass"
            )
        value = lookup(item.index)
        if isinstance(value, io.BytesIO):
            return to_node(value.getvalue(), f"{self._where}: DCP fqn {fqn!r}"), True
        return to_node(value, f"{self._where}: DCP fqn {fqn!r}"), False

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Commit through ckptd's coordinator (DCP's coordinator rank, after every write)."""
        if self._alone is not None:
            self._alone.finish()
            return
        target = self._target
        if target is None:
            raise CkptError(f"{self._where}: finish() before prepare_global_plan()")
        t0 = time.perf_counter()
        shards: dict[int, ShardInfo] = {}
        chunks: dict[int, list[ChunkPlan]] = {r: [] for r in range(target.world_size)}
        tensors: dict[str, tuple[dm.Path, str]] = {}
        objects: dict[str, tuple[dm.Path, str]] = {}
        leaves: list[tuple[dm.Path, Any]] = []
        for rank_results in results:
            for wr in rank_results:
                w = wr.storage_data
                if not isinstance(w, _Written):
                    raise CkptError(f"{self._where}: a write result carries no ckptd shard")
                shards[w.rank] = w.shard
                fqn = wr.index.fqn
                path = dm.path_of(fqn, metadata.planner_data)
                if w.chunk is not None and w.key is not None:
                    chunks[w.rank].append(w.chunk)
                    if fqn not in tensors:
                        tensors[fqn] = (path, w.key)
                        leaves.append((path, {"tensor": w.key}))
                elif fqn not in objects:
                    objects[fqn] = (path, dm.BYTES_IO if w.bytes_io else dm.PLAIN)
                    leaves.append((path, w.node))
        for r in range(target.world_size):
            if r not in shards:  # DCP gave this rank nothing to write
                shards[r] = _commit.empty_shard(dataclasses.replace(target, rank=r))
        tree = dm.build_tree(leaves, f"job {self.path!r} step {self.step}")
        meta = {**self.metadata, dm.SECTION: dm.section(metadata.version, tensors, objects)}
        assert self._conn is not None
        _commit.commit(
            self._conn.client, target, shards, chunks, tree, meta, self.keep_last, self.timeout_s
        )
        log.info(
            "DCP save of job %s step %d committed by ckptd (%d ranks, %.2f s to commit)",
            self.path,
            self.step,
            target.world_size,
            time.perf_counter() - t0,
        )


def _write_item(planner: SavePlanner, item: Any, key: str, where: str) -> WriteItem:
    """A DCP tensor item as a ckptd writer item: the chunk's bytes, on the CPU."""
    td = item.tensor_data
    fqn = item.index.fqn
    name = dtypes.name_of(td.properties.dtype)
    if name is None:
        raise UnsupportedValue(
            f"{where}: DCP fqn {fqn!r} has dtype {td.properties.dtype}, which ckptd cannot store"
        )
    t = planner.resolve_data(item)
    if not isinstance(t, torch.Tensor):
        raise UnsupportedValue(
            f"{where}: DCP fqn {fqn!r} resolved to {type(t).__name__}, not a tensor"
        )
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    sizes = list(td.chunk.sizes)
    if list(t.shape) != sizes:
        raise UnsupportedValue(
            f"{where}: DCP fqn {fqn!r}: the chunk is {list(t.shape)}, the plan says {sizes}"
        )
    return WriteItem(key, name, list(td.size), list(td.chunk.offsets), sizes, tensor_bytes(t))


class StorageReader(_DCPReader):
    """Load step `step` (default: the newest committed) of the ckptd job at `path` with DCP.

    Every byte is read through ckptd's reader and checked against its blake3 before it
    reaches the state dict; DCP's planner reshards to any world size and placement.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        step: int | None = None,
        *,
        io_threads: int | None = None,
    ):
        super().__init__()
        self.path = JobLocation.of(path).path
        self.step = None if step is None else layout.check_step(step)
        self.io_threads = io_threads
        self.rank = 0
        self._ck: ckfmt.OpenCheckpoint | None = None
        self._keys: dict[str, str] = {}
        self._objects: dict[str, Any] = {}

    @property
    def _where(self) -> str:
        step = self._ck.step if self._ck is not None else self.step
        return f"job {self.path!r} step {step} rank {self.rank}"

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            self.path = JobLocation.of(checkpoint_id).path
        self._ck = None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False

    def read_metadata(self) -> Metadata:
        """Open the step (manifest, index hashes, shard sizes checked) and rebuild Metadata."""
        self._ck = ckfmt.open_checkpoint(open_storage(self.path), self.step)
        meta, self._keys, self._objects = dm.metadata_from(self._ck)
        return meta

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        self.rank = int(kwargs.get("rank", _world.rank_and_world()[0]))

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        assert self._ck is not None
        return dataclasses.replace(plan, storage_data=self._ck.step)

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        steps = sorted({p.storage_data for p in plans if p.storage_data is not None})
        if len(steps) > 1:
            raise CkptError(
                f"job {self.path!r}: the ranks opened different steps {steps} (a save committed "
                "while they resolved the newest); pass StorageReader(path, step=N)"
            )
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read every item's box, verified, into the planner's tensors; bytes from JSON."""
        ck = self._ck
        if ck is None:
            raise CkptError(f"{self._where}: read_data() before read_metadata()")
        boxes: list[BoxRead] = []
        done: list[tuple[ReadItem, torch.Tensor, torch.Tensor | None]] = []
        devices = DeviceLoads()  # CUDA targets take each verified block as it is hashed
        for item in plan.items:
            fqn = item.storage_index.fqn
            if item.type == LoadItemType.BYTE_IO:
                planner.load_bytes(item, self._bytes(fqn))
                continue
            key = self._keys.get(fqn)
            if key is None:
                raise CkptError(
                    f"{self._where}: DCP asks for {fqn!r}, which is no tensor of this step"
                )
            dest = planner.resolve_tensor(item).detach()
            saved = dtypes.from_name(ck.chunks[key][0].entry.dtype)
            chunk_off = item.storage_index.offset or torch.Size([0] * len(item.lengths))
            box_off = [a + b for a, b in zip(chunk_off, item.storage_offsets, strict=True)]
            shaped = list(dest.shape) == list(item.lengths)
            streamed = devices.dest(ck, key, dest, saved, box_off, item.lengths) if shaped else None
            if streamed is not None:
                boxes.append(BoxRead(key, box_off, list(item.lengths), streamed))
                done.append((item, dest, None))
                continue
            direct = readable_in_place(dest, saved) and shaped
            buf = dest if direct else torch.empty(list(item.lengths), dtype=saved)
            boxes.append(BoxRead(key, box_off, list(item.lengths), tensor_bytes(buf)))
            done.append((item, dest, None if direct else buf))
        try:
            try:
                read_boxes(ck, boxes, threads=self.io_threads)
            finally:
                devices.finish()
        except CorruptCheckpoint as e:
            raise type(e)(
                f"{self._where}: DCP load through ckptd failed verification: {e}. Nothing "
                f"corrupt reached the state dict; run `ckptctl verify {self.path} --step "
                f"{ck.step}` and load an earlier step (StorageReader(path, step=...))"
            ) from None
        for item, dest, staged in done:
            if staged is not None:  # not read in place: another dtype, device or layout
                dest.copy_(staged.reshape(dest.shape))
            planner.commit_tensor(item, dest)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _bytes(self, fqn: str) -> io.BytesIO:
        """What DCP's planner expects for a bytes item, made here from the stored JSON."""
        entry = self._objects.get(fqn)
        if entry is None:
            raise CkptError(f"{self._where}: DCP asks for value {fqn!r}, which this step lacks")
        bytes_io, node = entry
        value = from_node(node)
        if bytes_io:
            value = io.BytesIO(value)
        out = io.BytesIO()
        torch.save(value, out)  # DCP's load_bytes reads it back with torch.load
        out.seek(0)
        return out


def dcp_to_torch_save(
    path: str | os.PathLike[str], torch_save_path: str | os.PathLike[str], step: int | None = None
) -> None:
    """DCP's format_utils.dcp_to_torch_save from a ckptd job: step `step` (default the
    newest committed) loaded whole in this process, every byte verified, then torch.save'd."""
    sd: dict[str, Any] = {}
    _load_state_dict(
        sd,
        storage_reader=StorageReader(path, step),
        planner=_EmptyStateDictLoadPlanner(),
        no_dist=True,
    )
    torch.save(sd, torch_save_path)


def torch_save_to_dcp(
    torch_save_path: str | os.PathLike[str], path: str | os.PathLike[str], step: int
) -> None:
    """DCP's format_utils.torch_save_to_dcp into step `step` of a ckptd job. The file is
    read with torch.load(weights_only=True): tensors and plain containers, nothing else is
    unpickled (DCP's own reads it with weights_only=False)."""
    state_dict = torch.load(torch_save_path, weights_only=True)
    _save_state_dict(state_dict, storage_writer=StorageWriter(path, step), no_dist=True)


def load(
    state_dict: dict[str, Any],
    path: str | os.PathLike[str],
    step: int | None = None,
    *,
    planner: LoadPlanner | None = None,
    fallback: bool = True,
    io_threads: int | None = None,
) -> int:
    """dcp.load(state_dict) from the ckptd job at `path` under ckpt's load policy; the step.

    Without `step` (and with fallback), every rank of the process group calls it: the
    newest committed step in every rank's view is loaded, and when a rank finds it damaged
    (CorruptCheckpoint: a hash mismatch, a missing shard) it is quarantined and every rank
    loads the next older one (module docstring). An explicit step is that step or an error.
    """
    rank = _world.rank_and_world()[0]
    job = JobLocation.of(path).path

    def loader(st: Storage, at: int) -> _DCPStep:
        return _DCPStep(state_dict, job, at, planner, io_threads, rank)

    res = load_from_tiers(
        [("local", open_storage(job))],
        state_dict,
        step=step,
        fallback=fallback,
        rank=rank,
        threads=io_threads,
        read="each",
        loader=loader,
    )
    return int(res.step)


@dataclasses.dataclass
class _DCPStep:
    """One step as the load policy tries it: dcp.load through a StorageReader of it."""

    state_dict: dict[str, Any]
    job: str
    step: int
    planner: LoadPlanner | None
    io_threads: int | None
    rank: int

    def read(self, reads: Any) -> LoadResult:
        t0 = time.perf_counter()
        reader = StorageReader(self.job, self.step, io_threads=self.io_threads)
        try:
            _dcp_load(self.state_dict, storage_reader=reader, planner=self.planner)
        except CheckpointException as e:
            # DCP gathers every rank's failure into one exception on every rank; the policy
            # needs this rank's damage as damage, another rank's as a peer's.
            failures = {r: exc for r, (exc, _) in e.failures.items()}
            mine = failures.get(self.rank)
            if isinstance(mine, CorruptCheckpoint):
                raise mine from None
            other = next(
                ((r, f) for r, f in failures.items() if isinstance(f, CorruptCheckpoint)), None
            )
            if other is not None:
                raise PeerReadFailed(
                    f"job {self.job!r} step {self.step}: rank {other[0]} found it damaged "
                    f"while DCP loaded it: {other[1]}"
                ) from None
            raise
        return LoadResult(
            step=self.step,
            path=f"{self.job}/{layout.step_dir(self.step)}",
            bytes=0,  # DCP's reads are not counted here
            seconds=time.perf_counter() - t0,
            metadata=reader._ck.manifest.metadata if reader._ck is not None else {},
        )
