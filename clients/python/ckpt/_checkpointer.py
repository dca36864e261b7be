"""Checkpointer: many ranks, one coordinator, a checkpoint committed only when whole.

A save on each rank: flatten the state; hash every chunk (blake3 per block, threads);
BeginSave with the plan (waits for every rank; the coordinator dedups replicas and says
which chunks this rank writes); write + fsync + verify this rank's shard; ReportShard;
AwaitCommit. While writing, a thread renews the rank's lease. Any failure on a rank
aborts the save for all ranks; nothing is committed and the error names job, step, rank.

No torch.distributed collective is used: ranks coordinate only through the coordinator,
so a slow or dead rank never hangs the others' training collectives. (The process
group's key-value store is used once, at start, to find a zero-config coordinator.)
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import uuid
from typing import Any

from ckpt import _world
from ckpt._api import LoadResult, SaveResult, _check_metadata
from ckpt._embedded import EmbeddedCoordinator
from ckpt._flatten import flatten
from ckpt._restore import Planner
from ckpt._transport import CoordinatorClient
from ckptd.coordinator.core import SaveRef, ShardReport
from ckptd.coordinator.planning import ChunkPlan
from ckptd.errors import CkptError, SaveAborted, SaveFailed
from ckptd.faults import crash_point
from ckptd.format import checkpoint as ckfmt
from ckptd.format import hashing, layout
from ckptd.format.writer import ShardWriteStats, WriteItem, hash_items, write_shard
from ckptd.storage import open_storage

log = logging.getLogger("ckpt")


class Checkpointer:
    """Saves and loads one job's checkpoints from every rank.

    path: the job's checkpoint directory (shared by all ranks).
    coordinator: "host:port" of a `ckptd serve`; default $CKPTD_ADDRESS, else zero-config
        (this process, or rank 0 under torchrun, hosts one).
    keep_last: keep the newest N committed steps (None: keep all).
    attempt: names this launch of the job (see ckpt._world); older attempts are fenced.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        keep_last: int | None = None,
        coordinator: str | None = None,
        token: str | None = None,
        attempt: str | None = None,
        verify: str = "full",
        allow_divergent_replicas: bool = False,
        timeout_s: float = 600.0,
        lease_s: float = 60.0,
        tls_root_cert: bytes | None = None,
        tls_client_cert: tuple[bytes, bytes] | None = None,
    ):
        if verify not in ("full", "size"):
            raise ValueError(f"verify must be 'full' or 'size', got {verify!r}")
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"keep_last must be at least 1, got {keep_last}")
        p = os.fspath(path)
        self.path = p if "://" in p else os.path.realpath(os.path.abspath(p))
        self.keep_last = keep_last
        self.verify = verify
        self.allow_divergent = allow_divergent_replicas
        self.timeout_s = timeout_s
        self.rank, self.world_size = _world.rank_and_world()
        self._embedded: EmbeddedCoordinator | None = None
        self._closed = False
        address = coordinator or os.environ.get("CKPTD_ADDRESS")
        token = token if token is not None else os.environ.get("CKPTD_TOKEN")
        attempt = _world.attempt_id(attempt, self.world_size)
        if address is None:
            address, token, attempt = self._zero_config(attempt, lease_s)
        elif attempt is None:
            attempt = self._shared_attempt()
        self.client = CoordinatorClient(
            address, token=token, root_certificates=tls_root_cert, client_cert=tls_client_cert
        )
        self.address = address
        self.attempt = attempt
        self.generation, self.job_name = self.client.open_job(self.path, attempt)
        self.storage = open_storage(self.path, create=True)

    # -- setup -------------------------------------------------------------------------
    def _zero_config(self, attempt: str | None, lease_s: float) -> tuple[str, str | None, str]:
        if self.world_size == 1:
            self._embedded = EmbeddedCoordinator(
                self.path, lease_s=lease_s, barrier_timeout_s=self.timeout_s
            )
            return (
                self._embedded.address,
                self._embedded.token,
                attempt or f"process-{uuid.uuid4()}",
            )
        store = _world.dist_store()
        key = f"ckptd/coordinator/{self.path}"
        if store is None:
            raise CkptError(
                f"job {self.path!r} rank {self.rank} of {self.world_size}: no coordinator address and no "
                "torch.distributed process group to find one; call dist.init_process_group() before "
                "creating the Checkpointer, or start `ckptd serve` and set CKPTD_ADDRESS"
            )
        if self.rank == 0:
            single_node = os.environ.get("LOCAL_WORLD_SIZE") == str(self.world_size)
            host = "127.0.0.1" if single_node else "0.0.0.0"  # noqa: S104 - other nodes must reach it
            self._embedded = EmbeddedCoordinator(
                self.path, host=host, lease_s=lease_s, barrier_timeout_s=self.timeout_s
            )
            info = {
                "address": self._embedded.address,
                "token": self._embedded.token,
                "attempt": attempt or str(uuid.uuid4()),
            }
            store.set(key, json.dumps(info))  # type: ignore[attr-defined]
        else:
            info = json.loads(store.get(key))  # type: ignore[attr-defined]
        return info["address"], info["token"], info["attempt"]

    def _shared_attempt(self) -> str:
        store = _world.dist_store()
        if store is None:
            raise CkptError(
                f"job {self.path!r} rank {self.rank} of {self.world_size}: cannot name this launch; "
                "pass attempt=... (the same on every rank, new for every launch) or set CKPT_ATTEMPT"
            )
        key = f"ckptd/attempt/{self.path}"
        if self.rank == 0:
            store.set(key, str(uuid.uuid4()))  # type: ignore[attr-defined]
        return str(store.get(key).decode())  # type: ignore[attr-defined]

    # -- save --------------------------------------------------------------------------
    def save(self, state: Any, step: int, *, metadata: dict[str, Any] | None = None) -> SaveResult:
        """Save `state` as `step` from this rank; returns when the step is committed."""
        self._check_open()
        t0 = time.perf_counter()
        layout.check_step(step)
        meta = _check_metadata(metadata)
        ref = SaveRef(self.path, step, self.generation, self.rank, self.world_size)
        where = f"job {self.path!r} step {step} rank {self.rank}/{self.world_size}"
        node, leaves = flatten(state, rank=self.rank)
        items = [
            WriteItem(
                leaf.key, leaf.dtype, leaf.shape, leaf.chunk_offsets, leaf.chunk_sizes, leaf.data
            )
            for leaf in leaves
        ]
        crash_point("rank.after_stage")
        digests = hash_items(items)
        plan = [
            ChunkPlan(
                it.key,
                it.dtype,
                tuple(it.shape),
                tuple(it.chunk_offsets),
                tuple(it.chunk_sizes),
                it.data.nbytes,
                hashing.chunk_digest(d),
            )
            for it, d in zip(items, digests, strict=True)
        ]
        begun = self.client.begin_save(
            ref,
            plan,
            state=node,
            metadata=meta,
            allow_divergent=self.allow_divergent,
            keep_last=self.keep_last or 0,
            timeout_s=self.timeout_s,
        )
        for w in begun.warnings:
            log.warning("%s: %s", where, w)
        stop = threading.Event()
        pinger = threading.Thread(
            target=self._keep_alive, args=(ref, begun.lease_s, stop), daemon=True
        )
        pinger.start()
        stats = ShardWriteStats()
        try:
            info = write_shard(
                self.storage,
                job=self.path,
                step=step,
                rank=self.rank,
                world_size=self.world_size,
                generation=self.generation,
                items=[items[i] for i in begun.write],
                verify=self.verify,
                digests=[digests[i] for i in begun.write],
                stats=stats,
            )
            report = ShardReport(
                info.path, info.size, info.index, info.index_size, info.index_blake3, self.verify
            )
            crash_point("rank.before_report")
            status = self.client.report_shard(ref, report)
            crash_point("rank.after_report")
            if status.status != "ABORTED":
                status = self.client.await_commit(ref, self.timeout_s)
        except BaseException as e:
            stop.set()
            self._abort_quietly(ref, f"{type(e).__name__}: {e}")
            raise
        finally:
            stop.set()
        if status.status != "COMMITTED":
            raise SaveAborted(
                f"{where}: the save was not committed ({status.status}): {status.reason}"
            )
        seconds = time.perf_counter() - t0
        return SaveResult(
            step=step,
            path=f"{self.storage.url}/{layout.step_dir(step)}",
            bytes=info.size,
            seconds=seconds,
            write_s=stats.write_s,
            verify_s=stats.verify_s,
            tensors=len(begun.write),
        )

    def _keep_alive(self, ref: SaveRef, lease_s: float, stop: threading.Event) -> None:
        while not stop.wait(max(0.05, lease_s / 3)):
            try:
                st = self.client.keep_alive(ref)
            except CkptError as e:
                log.debug("keep-alive for step %d failed: %s", ref.step, e)
                continue
            if st.status in ("ABORTED", "COMMITTED"):
                return

    def _abort_quietly(self, ref: SaveRef, reason: str) -> None:
        try:
            self.client.abort_save(ref, reason)
        except CkptError as e:
            log.warning("could not tell the coordinator that step %d failed: %s", ref.step, e)

    # -- load --------------------------------------------------------------------------
    def load(self, state: Any, step: int | None = None, *, strict: bool = True) -> LoadResult:
        """Load `step` (default: newest committed) into `state` on this rank, verified."""
        self._check_open()
        t0 = time.perf_counter()
        ck = ckfmt.open_checkpoint(self.storage, step)
        planner = Planner(ck, strict=strict, rank=self.rank)
        restored = planner.restore(ck.manifest.state, state, "")
        planner.check()
        nbytes = planner.read()
        return LoadResult(
            step=ck.step,
            path=f"{self.storage.url}/{layout.step_dir(ck.step)}",
            bytes=nbytes,
            seconds=time.perf_counter() - t0,
            tensors=len(planner.dests),
            metadata=ck.manifest.metadata,
            state=restored,
        )

    def latest_step(self) -> int | None:
        return ckfmt.latest_step(self.storage)

    # -- lifecycle ---------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise SaveFailed(f"job {self.path!r}: this Checkpointer is closed")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.client.close()
        if self._embedded is not None:
            self._embedded.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
