"""What one agent holds: step directories in its shared-memory root, under a budget.

The root is a job directory of its own (format v2: step-N/shards/..., MANIFEST.json), so
what the agent holds is read by the same code as storage (ckptd.format.checkpoint). A
shard arrives either written in place by a rank of this node (`prepare`, then `seal`) or
sent by another node's agent (`receive`). Either way the index is checked against the
digest the rank reported, and the shard's size against the index, before the shard counts
as held; a shard that arrived over TCP also has every block hashed against the index (one
a rank wrote here is hashed by the peer it is sent to and by every restore: seal says
why). A step is committed here when the memory commit's manifest is written (`commit`),
which the agent does only when it holds every shard the manifest names.

The budget (`max_steps`, `max_bytes`) is enforced before a shard is written: the oldest
steps are evicted, never the newest committed one nor the step being written, and a shard
that still does not fit is refused with MemoryBudgetExceeded naming the budget.
"""

from __future__ import annotations

import dataclasses
import logging
import mmap
import os
import socket
import threading
from typing import Any

from ckptd.agent import wire
from ckptd.errors import CkptError, HashMismatch, InvalidRequest, MemoryBudgetExceeded
from ckptd.format import checkpoint as ckfmt
from ckptd.format import hashing, layout
from ckptd.format.manifest import (
    Manifest,
    ShardInfo,
    load_index_json,
    parse_index,
    parse_manifest,
)
from ckptd.format.reader import verify_entries
from ckptd.storage.local import LocalStorage
from ckptd.storage.paths import check_relative

log = logging.getLogger("ckptd.agent")

MAX_INDEX_BYTES = 64 << 20
MAX_ENTRIES = 1 << 20


@dataclasses.dataclass(frozen=True)
class Budget:
    max_steps: int | None = None
    max_bytes: int | None = None

    def describe(self) -> str:
        steps = "unbounded" if self.max_steps is None else str(self.max_steps)
        size = "unbounded" if self.max_bytes is None else f"{self.max_bytes} bytes"
        return f"max_steps={steps}, max_bytes={size}"


@dataclasses.dataclass
class _Step:
    step: int
    bytes: int
    committed: bool
    order: float  # when it was last written or committed: eviction goes oldest first


class Holdings:
    """The shared-memory root of one node's agent."""

    def __init__(self, root: str, budget: Budget, *, node: int = 0):
        self.storage = LocalStorage(root, direct_io=False, early_writeback=False, create=True)
        self.root = self.storage.root
        self.budget, self.node = budget, node
        self._lock = threading.Lock()
        self._reserved: dict[tuple[int, str], int] = {}

    # -- accounting --------------------------------------------------------------------
    def steps(self) -> list[_Step]:
        out = []
        for name in os.listdir(self.root):
            step = layout.parse_step_dir(name)
            if step is None:
                continue
            full = os.path.join(self.root, name)
            size = 0
            newest = os.stat(full).st_mtime
            for dirpath, _, files in os.walk(full):
                for f in files:
                    st = os.stat(os.path.join(dirpath, f))
                    size += st.st_size
                    newest = max(newest, st.st_mtime)
            committed = os.path.exists(os.path.join(full, layout.MANIFEST_NAME))
            out.append(_Step(step, size, committed, newest))
        return out

    def _pending_bytes(self) -> int:
        """Reserved bytes not yet on disk: a shard being written counts once, as the
        larger of its reservation and what its file already holds."""
        out = 0
        for (_, path), n in self._reserved.items():
            try:
                out += max(0, n - os.stat(self.storage.full(path)).st_size)
            except OSError:
                out += n
        return out

    def usage(self) -> dict[str, Any]:
        with self._lock:
            held = self.steps()
            return {
                "bytes": sum(s.bytes for s in held) + self._pending_bytes(),
                "steps": sorted(s.step for s in held),
                "committed": sorted(s.step for s in held if s.committed),
                "budget": dataclasses.asdict(self.budget),
            }

    def _make_room(self, step: int, nbytes: int, what: str) -> None:
        """Evict until `nbytes` more of `step` fit; refuse when they cannot (lock held)."""
        b = self.budget
        if b.max_bytes is not None and nbytes > b.max_bytes:
            raise MemoryBudgetExceeded(
                f"{what}: {nbytes} bytes do not fit the memory agent's budget on node "
                f"{self.node} ({b.describe()}) even with nothing else held; raise "
                "max_bytes (MemoryTier) or save this step to storage only"
            )
        while True:
            held = self.steps()
            used = sum(s.bytes for s in held) + self._pending_bytes()
            n_steps = len({s.step for s in held} | {step} | {k for k, _ in self._reserved})
            over_bytes = b.max_bytes is not None and used + nbytes > b.max_bytes
            over_steps = b.max_steps is not None and n_steps > b.max_steps
            if not over_bytes and not over_steps:
                return
            committed = [s for s in held if s.committed]
            newest = max(committed, key=lambda s: s.order).step if committed else None
            pending = {k for k, _ in self._reserved}
            victims = [s for s in held if s.step not in (step, newest) and s.step not in pending]
            if not victims:
                raise MemoryBudgetExceeded(
                    f"{what}: {nbytes} bytes do not fit the memory agent's budget on node "
                    f"{self.node} ({b.describe()}): {used} bytes in steps "
                    f"{sorted(s.step for s in held)} are held and only the newest committed "
                    f"step ({newest}) and steps being written remain; raise the budget "
                    "(MemoryTier max_bytes / max_steps)"
                )
            # Debris of saves that never committed first, then the oldest committed step.
            victim = min(victims, key=lambda s: (s.committed, s.order))
            log.info(
                "memory agent node %d: evicting step %d (%d bytes) for %s",
                self.node,
                victim.step,
                victim.bytes,
                what,
            )
            self.storage.remove_tree(layout.step_dir(victim.step))

    # -- a rank of this node writes its shard in place ---------------------------------
    def prepare(self, step: int, files: list[str], nbytes: int) -> None:
        """Make room for `nbytes` of `step` and clear the named files of an older save."""
        layout.check_step(step)
        names = [self._in_step(step, f) for f in files]
        what = f"step {step} {files[0] if files else ''}".strip()
        with self._lock:
            sdir = layout.step_dir(step)
            if self.storage.exists(f"{sdir}/{layout.MANIFEST_NAME}"):
                # A save of a step held from an abandoned line (a rollback): memory is a
                # cache, the new save replaces it.
                self.storage.remove_tree(sdir)
            for name in names:
                if self.storage.exists(name):
                    self.storage.remove_tree(name)
            self._make_room(step, nbytes, what)
            self._reserved[(step, names[0] if names else sdir)] = nbytes
            self.storage.makedirs(f"{sdir}/{layout.SHARDS_DIR}")

    def release(self, step: int, files: list[str]) -> None:
        with self._lock:
            key = (step, self._in_step(step, files[0]) if files else layout.step_dir(step))
            self._reserved.pop(key, None)

    def seal(self, header: dict[str, Any]) -> tuple[ShardInfo, str]:
        """Check a shard a rank of this node wrote in place: its index's digest and
        entries, the shard's size; returns the shard and the index digest computed here.

        Its blocks are not hashed again here: the rank hashed them as it staged them (the
        index holds those hashes), the peer agent hashes every block of this very file on
        arrival (a block the rank wrote wrong fails there, and the step is not committed),
        and every restore hashes every block before it reaches a tensor. A third pass
        over the same memory, on the node the training runs on, would only cost cores."""
        step, shard = self._shard_of(header)
        try:
            digest = self._verify(step, shard, blocks=False)
        except BaseException:
            self._remove(step, shard)
            raise
        finally:
            self.release(step, [shard.path, shard.index])
        return shard, digest

    # -- another node's agent sends a shard ---------------------------------------------
    def receive(self, sock: socket.socket, header: dict[str, Any]) -> tuple[ShardInfo, str]:
        """Write the shard and index that follow the header, then check them like seal."""
        step, shard = self._shard_of(header)
        if header["nbytes"] != shard.size + shard.index_size:
            raise InvalidRequest(
                f"step {step} rank {shard.rank}: payload of {header['nbytes']} bytes, the "
                f"shard and index are {shard.size} + {shard.index_size}"
            )
        self.prepare(step, [shard.path, shard.index], shard.size + shard.index_size)
        try:
            sdir = layout.step_dir(step)
            for name, size in ((shard.path, shard.size), (shard.index, shard.index_size)):
                full = self.storage.full(f"{sdir}/{name}")
                fd = os.open(full, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
                try:
                    os.ftruncate(fd, size)
                    if size:
                        with mmap.mmap(fd, size) as mm:
                            view = memoryview(mm)
                            try:
                                wire.recv_into(sock, view)
                            finally:
                                view.release()
                finally:
                    os.close(fd)
            digest = self._verify(step, shard)
        except BaseException:
            self._remove(step, shard)
            raise
        finally:
            self.release(step, [shard.path, shard.index])
        return shard, digest

    # -- the memory commit ----------------------------------------------------------------
    def commit(self, data: bytes) -> list[int]:
        """Write the manifest of a step the coordinator committed (every shard is held on
        enough nodes, not all on this one: a ring of more nodes than copies spreads them,
        and a load reads the others from their holders, ckptd.agent.client.HeldStorage).
        Returns the ranks whose shards are not held here; nothing is written when this
        agent holds none of the step."""
        m = parse_manifest(data, what="memory commit MANIFEST.json")
        sdir = layout.step_dir(m.step)
        with self._lock:
            missing = []
            for s in m.shards:
                try:
                    ckfmt.check_shard_size(self.storage, m, s)
                    if self.storage.size(f"{sdir}/{s.index}") != s.index_size:
                        missing.append(s.rank)
                except CkptError:
                    missing.append(s.rank)
            if len(missing) == len(m.shards):
                return missing
            mpath = f"{sdir}/{layout.MANIFEST_NAME}"
            if self.storage.exists(mpath):
                if self.storage.read_bytes(mpath, limit=len(data) + 1) == data:
                    return missing
                self.storage.remove_tree(mpath)
            # The coordinator's bytes, as they are (their digest is the one it recorded);
            # the shards not held here are read from their holders.
            self.storage.create_only(mpath, data)
            # A commit makes this the newest committed step: older ones over the step
            # budget may go now.
            self._make_room(m.step, 0, f"step {m.step} commit")
        return missing

    def drop(self, step: int) -> None:
        with self._lock:
            self.storage.remove_tree(layout.step_dir(layout.check_step(step)))

    # -- helpers ---------------------------------------------------------------------------
    def shard_files(self, step: int, shard: ShardInfo) -> list[tuple[str, int]]:
        sdir = layout.step_dir(step)
        return [(f"{sdir}/{shard.path}", shard.size), (f"{sdir}/{shard.index}", shard.index_size)]

    def _in_step(self, step: int, name: str) -> str:
        return f"{layout.step_dir(step)}/{check_relative(name, what='shard file')}"

    def _shard_of(self, header: dict[str, Any]) -> tuple[int, ShardInfo]:
        try:
            step = layout.check_step(header["step"])
            s = header["shard"]
            shard = ShardInfo(
                int(s["rank"]),
                check_relative(s["path"], what="shard path"),
                int(s["size"]),
                check_relative(s["index"], what="index path"),
                int(s["index_size"]),
                str(s["index_blake3"]),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise InvalidRequest(f"agent request: a bad shard description ({e!r})") from None
        if not shard.path.startswith(f"{layout.SHARDS_DIR}/") or shard.index_size > MAX_INDEX_BYTES:
            raise InvalidRequest(f"step {step} rank {shard.rank}: not a shard ({shard.path})")
        return step, shard

    def _verify(self, step: int, shard: ShardInfo, *, blocks: bool = True) -> str:
        """The index is the one the rank reported (its digest), the shard its size, and
        (blocks) every block of the shard hashes to what the index says: the hashes
        computed at save travel with it."""
        sdir = layout.step_dir(step)
        where = f"memory agent node {self.node} step {step} rank {shard.rank}"
        data = self.storage.read_bytes(f"{sdir}/{shard.index}", limit=MAX_INDEX_BYTES)
        digest = hashing.digest(data)
        if digest != shard.index_blake3:
            raise HashMismatch(
                f"{where}: index {shard.index} does not hash to the digest the rank reported"
            )
        doc = load_index_json(data, shard.index)
        stub = Manifest(
            job=str(doc.get("job", "")) if isinstance(doc, dict) else "",
            step=step,
            generation=int(doc.get("generation", 0)) if isinstance(doc, dict) else 0,
            world_size=int(doc.get("world_size", 1)) if isinstance(doc, dict) else 1,
            block_size=int(doc.get("block_size", 0)) if isinstance(doc, dict) else 0,
            alignment=int(doc.get("alignment", 0)) if isinstance(doc, dict) else 0,
            shards=[shard],
            state=None,
        )
        index = parse_index(
            None, manifest=stub, shard=shard, max_entries=MAX_ENTRIES, what=where, doc=doc
        )
        ckfmt.check_shard_size(self.storage, stub, shard)
        if not blocks:
            return digest
        problems = verify_entries(
            self.storage, f"{sdir}/{shard.path}", index.entries, stub.block_size
        )
        if problems:
            raise HashMismatch(
                f"{where}: {len(problems)} block(s) do not match the hashes computed at save "
                f"(first: {problems[0]}); the copy is refused"
            )
        return digest

    def _remove(self, step: int, shard: ShardInfo) -> None:
        for name, _ in self.shard_files(step, shard):
            try:
                self.storage.remove_tree(name)
            except OSError as e:
                log.warning("memory agent: could not remove %s: %s", name, e)
