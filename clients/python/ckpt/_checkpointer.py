"""Checkpointer: many ranks, one coordinator, a checkpoint committed only when whole.

A save on each rank: flatten the state; hash every chunk (blake3 per block, threads);
BeginSave with the plan (waits for every rank; the coordinator dedups replicas and says
which chunks this rank writes); write + fsync + verify this rank's shard; ReportShard;
AwaitCommit. While writing, a thread renews the rank's lease. Any failure on a rank
aborts the save for all ranks; nothing is committed and the error names job, step, rank.
A rank whose write fails because the coordinator aborted the save under it (and removed
its files) raises SaveAborted with the coordinator's reason, the storage error chained.

No torch.distributed collective is used: ranks coordinate only through the coordinator,
so a slow or dead rank never hangs the others' training collectives. (The process
group's key-value store is used once, at start, to find a zero-config coordinator.)
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import time
import weakref
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ckpt import _hooks, _resume, _world
from ckpt._connect import connect, wait_for_closed
from ckpt._flatten import flatten
from ckpt._gcclock import GcClock
from ckpt._load import load_from_tiers
from ckpt._memory import MemorySaver, MemoryTier
from ckpt._mirror import MirrorUploader
from ckpt._pending import PendingSave
from ckpt._persist import JOB_HEAD, Begun, Unset, begin, commit
from ckpt._protocol import RankSave
from ckpt._restore import LoadResult
from ckpt._results import SaveResult, check_metadata, log_saved
from ckpt._save_job import SaveJob, SaveOptions
from ckpt._staging import HostImage, prepare_for
from ckptd.coordinator.types import SaveRef
from ckptd.errors import CheckpointNotFound, CkptError, CoordinatorUnavailable, SaveFailed
from ckptd.faults import crash_point
from ckptd.format import checkpoint as ckfmt
from ckptd.format import layout
from ckptd.storage import JobLocation, Storage, open_storage

log = logging.getLogger("ckpt")


class Checkpointer:
    """Saves and loads one job's checkpoints from every rank.

    path: the job's checkpoint directory (shared by all ranks).
    coordinator: "host:port" of a `ckptd serve`; default $CKPTD_ADDRESS, else zero-config
        (this process, or rank 0 under torchrun, hosts one).
    keep_last: keep the newest N committed steps (None: keep all).
    incremental: write only the blocks whose bytes changed since the step this state
        descends from (every block hash compared); the others borrow the bytes of the
        steps that hold them (docs/format.md, Borrowed entries and blocks). For states
        with large unchanged parts (a frozen base under LoRA, reference models, embedding
        rows no batch touched); nothing is saved when every weight changes. Off by
        default: a step that borrows is format version 3 (4 when it borrows blocks of an
        entry), which older ckptd refuse, and its lenders stay while it is kept.
    mirror: a second tier (an fsspec URL such as "s3://bucket/job", a path, or a Storage
        built with its own options, e.g. FsspecStorage(url, endpoint_url=...)): each
        committed step is copied there in the background, read back and verified, and
        committed there too (ckpt._mirror); loads fall back to it (ckpt._load).
    mirror_keep_last: retention in the mirror (None: keep all); independent of keep_last.
    mirror_close_timeout_s: how long close() waits for the last copy to the mirror.
    memory: a MemoryTier: maybe_save also takes memory checkpoints every `memory.every`
        steps, held by each node's agent in shared memory and on a peer node; resume
        prefers them (ckpt._memory, docs/memory-tier.md).
    attempt: names this launch of the job (see ckpt._world); older attempts are fenced.
    save_on_preemption: install handlers for `preemption_signals` (default SIGTERM and
        SIGUSR1) that only note the signal; the next maybe_save() finishes the save in
        flight or takes one last blocking checkpoint, at the same step on every rank, and
        then the process exits as the signal asked (see ckpt._hooks), or, with
        exit_on_preemption=False, maybe_save returns and `preempted` says so.
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
        on_error: str = "raise",
        staging_budget_bytes: int | None = None,
        save_on_preemption: bool = False,
        preemption_signals: Sequence[int] = _hooks.DEFAULT_SIGNALS,
        exit_on_preemption: bool = True,
        mirror: str | os.PathLike[str] | Storage | None = None,
        mirror_keep_last: int | None = None,
        mirror_close_timeout_s: float = 600.0,
        memory: MemoryTier | None = None,
        incremental: bool = False,
    ):
        if on_error not in ("raise", "warn"):
            raise ValueError(f"on_error must be 'raise' or 'warn', got {on_error!r}")
        if mirror_keep_last is not None and mirror_keep_last < 1:
            raise ValueError(f"mirror_keep_last must be at least 1, got {mirror_keep_last}")
        self.options = SaveOptions(
            verify=verify,
            keep_last=keep_last,
            staging_budget_bytes=staging_budget_bytes,
            incremental=incremental,
        )
        if save_on_preemption:
            _hooks.check_main_thread()  # before anything is started that would need closing
        self.path = JobLocation.of(path).path
        self.allow_divergent = allow_divergent_replicas
        self.timeout_s = timeout_s
        self.rank, self.world_size = _world.rank_and_world()
        self._closed = False
        self._conn = connect(
            self.path,
            rank=self.rank,
            world_size=self.world_size,
            address=coordinator,
            token=token,
            attempt=attempt,
            lease_s=lease_s,
            barrier_timeout_s=timeout_s,
            tls_root_cert=tls_root_cert,
            tls_client_cert=tls_client_cert,
        )
        self.client = self._conn.client
        assert self._conn.save_client is not None
        self._save_client = self._conn.save_client  # the node's aggregator, or self.client
        self.address, self.attempt = self._conn.address, self._conn.attempt
        self.generation, self.job_name = self._conn.generation, self._conn.job_name
        self.storage = open_storage(self.path, create=True)
        self.mirror_storage = (
            mirror
            if mirror is None or isinstance(mirror, Storage)
            else open_storage(mirror, create=True)
        )
        self.mirror_close_timeout_s = mirror_close_timeout_s
        self._mirror = (
            MirrorUploader(
                self.storage,
                self.mirror_storage,
                job=self.path,
                keep_last=mirror_keep_last,
                record=self._record_mirror,
                rank=self.rank,  # every rank uploads its own shard (ckpt._mirror)
                world_size=self.world_size,
            )
            if self.mirror_storage is not None
            else None
        )
        if self._mirror is not None:
            # Catch up: a copy a previous run did not finish (killed, mirror down) is
            # redone; the thread finds out whether the mirror has it (then nothing moves).
            newest = ckfmt.latest_step(self.storage)
            if newest is not None:
                self._mirror.submit(newest)
        self.on_error = on_error
        self._image = HostImage()
        self._inflight: PendingSave | None = None
        # One background thread: saves persist in order, at most one at a time.
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="ckpt-persist")
        # The process group's store: ranks agree on resume and preemption steps through it.
        self._store = _world.dist_store() if self.world_size > 1 else None
        self._memory = None if memory is None else MemorySaver(
            memory, self.path, self.storage, self._store, token, (self.rank, self.world_size),
            (self.generation, self.attempt), allow_divergent=allow_divergent_replicas,
            client=self.client, image=self._image, persisting=self._persisting,
        )  # fmt: skip
        self._last_step: int | None = None  # the newest step saved or resumed here
        self.last_load: LoadResult | None = None
        # Steps the last load here passed over for NaN or Inf (require_finite): a save of
        # one of their numbers takes its place (_give_way) instead of being refused.
        self._passed_over: set[int] = set()
        # The step the next save descends from (its manifest's parent): the step last saved
        # or loaded here; JOB_HEAD before either (the job's live head, looked up once).
        self._parent: int | None | Unset = JOB_HEAD
        self._parent_before: int | None | Unset = JOB_HEAD  # before the save in flight
        self._signals = tuple(preemption_signals) if save_on_preemption else ()
        self.exit_on_preemption = exit_on_preemption
        self._stop_plan = _hooks.StopPlan(
            self._store, f"ckptd/preempt/{self.path}/{self.attempt}", self.rank
        )
        self._stopped = False
        if self._signals:
            if self.world_size > 1 and self._store is None:
                log.warning(
                    "job %s rank %d: save_on_preemption without a torch.distributed process "
                    "group: the ranks cannot agree on the last checkpoint's step, each stops "
                    "where it sees the signal",
                    self.path,
                    self.rank,
                )
            _hooks.install(self._signals)
        _open.add(self)

    # -- save --------------------------------------------------------------------------
    @property
    def keep_last(self) -> int | None:
        return self.options.keep_last

    @property
    def verify(self) -> str:
        return self.options.verify

    @property
    def last_step(self) -> int | None:
        """The newest step saved or resumed by this Checkpointer (None before either)."""
        return self._last_step

    @property
    def closed(self) -> bool:
        return self._closed

    def save(
        self,
        state: Any,
        step: int,
        *,
        metadata: dict[str, Any] | None = None,
        blocking: bool = False,
        if_busy: str = "wait",
        options: SaveOptions | None = None,
    ) -> PendingSave:
        """Save `state` as `step` from this rank.

        Returns as soon as the state is copied into host memory (the blocking part); hashing,
        planning, writing, verification and the commit run in the background. The returned
        PendingSave's wait() gives the SaveResult or raises the failure; a failure also
        raises at the next save() and at close() (unless on_error="warn").
        blocking=True returns only when the step is committed.
        if_busy: what to do while the previous save still persists: "wait" for it, or
        "skip" this one (the PendingSave is marked skipped).
        options: this save's SaveOptions instead of the Checkpointer's (the module-level
        ckpt.save passes its keyword arguments this way).
        """
        self._check_open()
        if if_busy not in ("wait", "skip"):
            raise ValueError(f"if_busy must be 'wait' or 'skip', got {if_busy!r}")
        layout.check_step(step)
        meta = check_metadata(metadata)
        prev = self._inflight
        if prev is not None and not prev.done():
            if if_busy == "skip":
                log.info(
                    "job %s step %d skipped: step %d is still persisting",
                    self.path,
                    step,
                    prev.step,
                )
                return PendingSave(step, skipped=True)
            prev.join()
        if prev is not None and prev.failed and self._parent == prev.step:
            self._parent = self._parent_before  # a save that failed is nobody's parent
        self._raise_unseen(prev)
        if step in self._passed_over:
            self._give_way(step)
        ref = SaveRef(self.path, step, self.generation, self.rank, self.world_size)
        # The stall: what the training loop waits for (and the collections in it).
        with GcClock() as collector:
            t0 = time.perf_counter()
            image: HostImage | None = None
            try:
                node, leaves = flatten(state, rank=self.rank, keep_device=True)
                t1 = time.perf_counter()
                # A memory save still writing out of the shared staging image: this save
                # stages into one of its own (ckpt._memory; they never wait for each other).
                shared = self._memory is None or not self._memory.holds_shared
                image = self._image if shared else HostImage()
                waited = image.waited_s
                job = SaveJob(self.storage, ref, node, meta, options or self.options, leaves, image)
                image_wait_s = image.waited_s - waited
            except BaseException as e:
                if image is not None:
                    self._release_own(image)
                # The other ranks must not wait for this one at the barrier.
                RankSave(self._save_client, ref, timeout_s=self.timeout_s).abort(
                    f"{type(e).__name__}: {e}"
                )
                raise
            del leaves  # the staged copy is what gets saved; the caller's tensors are free
            staging_s = time.perf_counter() - t1
            crash_point("rank.after_stage")
            # Past the staging budget the tensors are written before save() returns, and a
            # packed shard needs the plan for that (ckpt._save_job).
            begun = self._begin(job, self._parent) if job.over_budget else None
        pending = PendingSave(step)
        pending.timings.staging_s = staging_s
        pending.timings.image_wait_s = image_wait_s
        pending.timings.gc_s = collector.s
        pending.timings.blocking_s = time.perf_counter() - t0
        pending.bytes = job.held_bytes
        self._inflight = pending
        self._last_step = step
        parent, self._parent_before, self._parent = self._parent, self._parent, step
        if blocking:
            self._persist(job, pending, parent, begun)
            pending.wait()
            return pending
        self._worker.submit(self._persist, job, pending, parent, begun)
        return pending

    def wait(self, timeout: float | None = None) -> SaveResult | None:
        """Wait for the save in flight (if any); raises its failure."""
        p = self._inflight
        if p is None:
            return None
        if not p.join(timeout):
            raise TimeoutError(
                f"job {self.path!r} step {p.step}: still persisting after {timeout} s"
            )
        self._raise_unseen(p)
        return p.committed

    def _raise_unseen(self, p: PendingSave | None) -> None:
        if p is None:
            return
        err = p.take_unseen_error()
        if err is None:
            return
        if self.on_error == "warn":
            log.warning("job %s step %d failed in the background: %s", self.path, p.step, err)
            return
        raise err

    def _persist(
        self, job: SaveJob, pending: PendingSave, parent: int | None | Unset, begun: Begun | None
    ) -> None:
        """The background part of a save; records the outcome in `pending`, never raises."""
        t0 = time.perf_counter()
        try:
            b = begun or self._begin(job, parent)
            result = commit(job, pending, t0, b, storage=self.storage)
        except BaseException as e:  # handed to the training loop through the PendingSave
            self._release_own(job.host)
            pending.timings.persist_s = time.perf_counter() - t0
            pending.settle(None, e)
            if self.on_error == "warn":
                log.warning("job %s step %d failed: %s", self.path, job.step, e)
            return
        self._release_own(job.host)
        pending.timings.persist_s = time.perf_counter() - t0 - pending.timings.commit_s
        result = dataclasses.replace(result, **dataclasses.asdict(pending.timings))
        log_saved(result, f"job {self.path!r} step {job.step} rank {self.rank}/{self.world_size}")
        pending.settle(result, None)
        if self._mirror is not None:
            self._mirror.submit(job.step)  # committed locally: now the copy to the mirror

    def _release_own(self, image: HostImage) -> None:
        """A one-off staging image (a memory save held the shared one), once its save is
        written or has failed: unregistered from CUDA and unmapped now; garbage collection
        would unmap it still registered (the pinned pages and the registration would
        outlive the mapping). The shared image is kept."""
        if image is not self._image:
            image.release()

    def _begin(self, job: SaveJob, parent: int | None | Unset) -> Begun:
        """Hash and plan this rank's part of `job` (ckpt._persist.begin)."""
        return begin(
            job,
            parent,
            storage=self.storage,
            client=self._save_client,
            timeout_s=self.timeout_s,
            allow_divergent=self.allow_divergent,
            rank=self.rank,
            world_size=self.world_size,
        )

    # -- load --------------------------------------------------------------------------
    def load(
        self,
        state: Any,
        step: int | None = None,
        *,
        strict: bool = True,
        keys: str | list[str] | None = None,
        cast: bool = False,
        fallback: bool = True,
        read: str = "auto",
        require_finite: bool = False,
    ) -> LoadResult:
        """Load `step` (default: the head of the job's live line) into `state` on this
        rank, verified; the next save descends from the step loaded (a rollback when it is
        an older one: docs/concepts.md, Rollbacks and the live line).

        Reshards to this rank's DTensor placements whatever the world size at save time;
        keys/strict/cast/fallback/read/require_finite as in ckpt.load. With fallback and no explicit step
        (or read="shared"), every rank of an initialized process group must call this (they
        agree on the step, and each stored byte is read by one of them).
        """
        self._check_open()
        res = load_from_tiers(
            self.tiers,
            state,
            step=step,
            strict=strict,
            keys=keys,
            cast=cast,
            fallback=fallback,
            rank=self.rank,
            on_quarantine=self._tier_quarantined,
            catalog_blake3=self._catalog_blake3,
            read=read,
            require_finite=require_finite,
        )
        self._parent = self._parent_before = res.step
        self.last_load = res  # which step and tier (resume returns only the step)
        self._passed_over = set(res.unhealthy)
        return res

    def _give_way(self, step: int) -> None:
        """The last load here passed over `step` for NaN or Inf values (require_finite),
        and training has reached that step again: mark it quarantined, with that reason,
        in the local tier and the mirror, so that this save takes its place there
        (retention.make_way) instead of being refused, which would stop the job at that
        step after every restart. Every rank marks before its own BeginSave, so whichever
        rank opens the save finds the mark; a marker already there is kept (as a load's
        quarantine keeps a peer's). Whole steps are marked this way only by the
        Checkpointer whose load passed them over, and only for its save of that step."""
        self._passed_over.discard(step)
        reason = (
            "its saved stats count NaN or Inf values: a load with require_finite passed over "
            f"it, and a new save of step {step} takes its place"
        )
        for st in (self.storage, self.mirror_storage):
            if st is None:
                continue
            try:
                if st.exists(f"{layout.step_dir(step)}/{layout.MANIFEST_NAME}"):
                    ckfmt.quarantine(st, step, reason)
            except (CkptError, OSError) as e:
                log.warning("job %s: could not mark step %d in %s: %s", self.path, step, st.url, e)

    def _catalog_blake3(self, step: int) -> str | None:
        """The manifest digest the coordinator committed for `step`; None if it never saw
        the step (saved elsewhere, or a catalog rebuilt without it): storage alone decides."""
        try:
            info = self.client.get_checkpoint(self.path, step)
        except (CheckpointNotFound, CoordinatorUnavailable) as e:
            if self._memory is not None and isinstance(e, CheckpointNotFound):
                return None  # a memory step: its agents' commit is its record (ckpt._memory)
            # Storage alone describes a checkpoint (promise 6): a restore never depends on
            # the coordinator being up, so this check is skipped, loudly, when it is not.
            log.warning(
                "job %s step %d: %s; loading it on storage's word alone (its manifest is not "
                "checked against the catalog's commit record)",
                self.path,
                step,
                "not in the coordinator's catalog"
                if isinstance(e, CheckpointNotFound)
                else f"the coordinator is unreachable ({e})",
            )
            return None
        return info.manifest_blake3 or None

    @property
    def tiers(self) -> list[tuple[str, Any]]:
        """(name, Storage) of each tier, nearest first: "memory" (this node's) and "peer"
        (another node's) with a memory tier, "local" (the job's path), "mirror"."""
        out: list[tuple[str, Any]] = self._memory.tiers() if self._memory is not None else []
        out.append(("local", self.storage))
        if self.mirror_storage is not None:
            out.append(("mirror", self.mirror_storage))
        return out

    def _tier_quarantined(self, tier: str, step: int, reason: str) -> None:
        if tier == "local":
            self._quarantined(step, reason)
        else:
            kind = "mirror" if tier == "mirror" else "memory"
            self._record_tier(kind, step, "FAILED", f"{tier} copy quarantined: {reason}")

    def _record_mirror(self, step: int, status: str, reason: str) -> None:
        self._record_tier("mirror", step, status, reason)

    def _record_tier(self, tier: str, step: int, status: str, reason: str) -> None:
        """The coordinator's catalog records what the mirror / memory holds (RecordTier)."""
        place = self._memory if tier == "memory" else self.mirror_storage
        if place is not None:
            self.client.record_tier(self.path, step, tier, place.url, status, reason)

    def _quarantined(self, step: int, reason: str) -> None:
        """A load found `step` corrupt: record it in the coordinator's catalog too."""
        try:
            self.client.quarantine(self.path, step, reason)
        except CkptError as e:
            log.warning(
                "job %s: could not tell the coordinator that step %d is quarantined: %s",
                self.path,
                step,
                e,
            )

    def latest_step(self) -> int | None:
        """The head of the job's live line: what resume or load() without a step loads."""
        return ckfmt.latest_step(self.storage)

    # -- resume and the training loop ---------------------------------------------------
    def resume(
        self,
        state: Any,
        *,
        allow_fresh_start: bool = False,
        strict: bool = True,
        require_finite: bool = False,
    ) -> int | None:
        """Load the newest whole checkpoint into `state`; its step, or None for a new job.

        Every rank must call it; they load the same step. Steps that never committed,
        are marked bad, or fail verification are skipped (logged with the reason) and the
        previous one is tried; with require_finite, so are steps whose saved stats count
        NaN or Inf values (ckpt._load). Raises CheckpointNotFound when checkpoints exist
        but none loads, unless allow_fresh_start=True (then logs the error, returns None).
        """
        self._check_open()
        step = _resume.resume(
            self.path,
            self.tiers,
            self.load,
            state,
            rank=self.rank,
            allow_fresh_start=allow_fresh_start,
            strict=strict,
            require_finite=require_finite,
        )
        # After the load (not competing with it): map the first save's staging image.
        prepare_for(self._image, state, rank=self.rank, budget=self.options.staging_budget_bytes)
        if step is not None:
            self._last_step = step
        return step

    def maybe_save(
        self,
        state: Any,
        step: int,
        *,
        every: int | None = None,
        metadata: dict[str, Any] | None = None,
    ) -> PendingSave | None:
        """The one call a training loop makes after each step: saves when one is due.

        Saves (asynchronously) when `step` is a multiple of `every`, unless this step was
        just resumed from or saved. With save_on_preemption, a noted signal makes this the
        safe point: the save in flight is finished, or one last checkpoint is taken
        (blocking), then the process exits as the signal asked. Returns the PendingSave
        of the save it started or finished, else None.
        """
        self._check_open()
        if every is not None and every < 1:
            raise ValueError(f"every must be at least 1, got {every}")
        layout.check_step(step)
        if self._signals and not self._stopped:
            p = self._inflight
            inflight = p.step if p is not None and not p.done() else None
            stop = self._stop_plan.poll(step, _hooks.received(), inflight)
            if stop is not None:
                return self._last_checkpoint(state, step, metadata, stop)
        if step == self._last_step:
            return None
        if every is not None and step % every == 0:
            return self.save(state, step, metadata=metadata)
        if self._memory is not None and step % self._memory.tier.every == 0:
            return self.save_memory(state, step, metadata=metadata)
        return None

    def _persisting(self) -> bool:
        """A persistent save is still being written out of the staging image."""
        p = self._inflight
        return p is not None and not p.done()

    def save_memory(
        self, state: Any, step: int, *, metadata: dict[str, Any] | None = None
    ) -> PendingSave:
        """A memory checkpoint of `state` as `step` (needs memory=MemoryTier(...)): staged
        now, placed and committed in the background (ckpt._memory); its failure is logged
        and kept in the PendingSave, never raised into training."""
        self._check_open()
        if self._memory is None:
            raise ValueError(f"job {self.path!r}: save_memory needs Checkpointer(memory=...)")
        layout.check_step(step)
        parent = self._parent
        if isinstance(parent, Unset):
            parent = ckfmt.latest_step(self.storage)
        prev = self._inflight if self._inflight is not None and not self._inflight.done() else None
        pending = self._memory.save(
            state, step, parent=parent, metadata=check_metadata(metadata), after=prev
        )
        if not pending.skipped:
            self._last_step = self._parent = step
        return pending

    @property
    def preempted(self) -> int | None:
        """The signal that stopped the job (its last checkpoint is taken), else None."""
        stop = self._stop_plan.stop
        return stop.signum if self._stopped and stop is not None else None

    def _last_checkpoint(
        self, state: Any, step: int, metadata: dict[str, Any] | None, stop: _hooks.Stop
    ) -> PendingSave | None:
        """Finish the save in flight or take one last checkpoint; then exit (or report)."""
        self._stopped = True
        return _hooks.last_checkpoint(
            job=self.path,
            rank=self.rank,
            stop=stop,
            step=step,
            inflight=self._inflight,
            save=lambda: self.save(state, step, metadata=metadata, blocking=True),
            exit_after=self.exit_on_preemption,
        )

    # -- lifecycle ---------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise SaveFailed(f"job {self.path!r}: this Checkpointer is closed")

    def close(self) -> None:
        """Wait for the save in flight, then release the coordinator and buffers.

        Raises the in-flight save's failure (unless on_error="warn"). With
        save_on_preemption, a signal that no maybe_save acted on is delivered again once
        the handlers are restored: the process ends as that signal asked.
        """
        self._close(redeliver=True)

    def _close(self, *, redeliver: bool) -> None:
        if self._closed:
            return
        pending: int | None = None
        try:
            p = self._inflight
            if p is not None:
                p.join()
            if self._mirror is not None:
                self._mirror.close(self.mirror_close_timeout_s)
            if self._memory is not None:
                self._memory.close()
            self._wait_for_peers()
            self._closed = True
            self._worker.shutdown(wait=True)
            self._conn.close()
            self._image.release()
            _open.discard(self)
        finally:
            self._closed = True
            if self._signals:
                pending = _hooks.received() if not self._stopped else None
                if not _hooks.uninstall(self._signals):
                    pending = None  # another Checkpointer still holds the handlers
                self._signals = ()
        self._raise_unseen(p)
        if pending is not None and redeliver:
            log.warning(
                "job %s rank %d: %s arrived but no maybe_save() came after it, so no last "
                "checkpoint was taken; delivering it again",
                self.path,
                self.rank,
                _hooks.signal_name(pending),
            )
            _hooks.redeliver(pending)

    def _wait_for_peers(self, timeout_s: float = 30.0) -> None:
        """Rank 0 hosting the coordinator waits (bounded) until every rank has closed.

        Another rank may still be waiting for its last save's commit answer; stopping the
        coordinator under it would turn a committed save into an error on that rank.
        """
        if self._store is None:
            return
        if self._signals and _hooks.received() is not None and not self._stopped:
            # Signalled but leaving before a safe point (an exception on the way out, e.g. a
            # peer died): the launcher is tearing the job down; do not make it wait longer.
            return
        wait_for_closed(
            self._store,
            f"ckptd/closed/{self.path}/{self.attempt}/{self._conn.opened}",
            self.world_size,
            hosting=self._conn.embedded is not None,
            job=self.path,
            timeout_s=timeout_s,
        )

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is not None:
            # Do not hide the exception that is already propagating (nor kill the process
            # with a pending signal before its traceback is printed).
            try:
                self._close(redeliver=False)
            except BaseException as e:
                if self.on_error == "raise":
                    log.error("job %s: the save in flight failed too: %s", self.path, e)
                else:
                    raise
            return
        self.close()


# Checkpointers still open at interpreter exit flush their save in flight.
_open: weakref.WeakSet[Checkpointer] = weakref.WeakSet()


def open_on(path: str) -> Checkpointer | None:
    """This process's open Checkpointer of job `path` (normalised), the newest attempt's
    when there are several (it fences the others), else None."""
    mine = [cp for cp in list(_open) if cp.path == path and not cp.closed]
    return max(mine, key=lambda cp: cp.generation) if mine else None


@atexit.register
def _close_all() -> None:
    for cp in list(_open):
        try:
            cp.close()
        except BaseException as e:  # noqa: BLE001 - at exit, report and go on
            log.error("job %s: %s", cp.path, e)
