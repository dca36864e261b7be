"""The in-memory tier: checkpoints held in each node's shared memory and on a peer node.

A memory save (`MemorySaver.save`) stages the state like any save (its own host image),
then in the background: joins the memory save at the coordinator (ckpt._protocol's
MemoryRankSave: the MemorySave RPC, leased); hashes every block; the ranks exchange their
plans through the process group's store and each runs the coordinator's dedup
(ckptd.coordinator.planning, the same rule as a persistent save) to know what it writes;
it writes its packed shard and index straight into its node's shared-memory root
(ckpt._save_job, the shard writer as for storage); the node's agent checks every block
against the index, then sends the shard to the agents of the next `replicas` nodes of the
ring, which check it again on arrival, each answering with the index digest it computed.
The rank reports that to the coordinator, which commits the step when every shard is held
on at least two nodes with agreeing digests (ckptd.coordinator.memory), records the
"memory" tier in the catalog and answers with the manifest; each rank writes it into its
own node's agent. A memory save that is busy, refused (the agent's budget) or fails is
logged and reported in its PendingSave; it never raises into training, and persistent
saves are independent of it.

Restore reads this node's root directly ("memory": the steps it committed, each file from
here when held here, else from the ring node holding it) and the other nodes' agents
("peer"), both through ckptd.agent.client.HeldStorage; the load policy (ckpt._load)
treats them as the nearest tiers, so every byte is verified and a bad copy falls through
to the next.

The agent: the node's first rank starts `ckptd agent` (under a lock file in the root)
when none answers, detached so it outlives the ranks; Slurm or Kubernetes may start it
instead. Its token is the job's (token= / $CKPTD_TOKEN), else a random one rank 0 keeps
in the job directory (.ckptd-agent-token, so every attempt finds the same agents) and
hands to the other ranks through the store, as it does the coordinator's.
"""

from __future__ import annotations

import dataclasses
import datetime
import fcntl
import json
import logging
import os
import secrets
import socket
import subprocess
import sys
import time
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ckpt._flatten import flatten
from ckpt._gcclock import GcClock
from ckpt._pending import PendingSave
from ckpt._protocol import MemoryRankSave
from ckpt._results import SaveResult
from ckpt._save_job import SaveJob, SaveOptions
from ckpt._staging import HostImage
from ckptd import knobs
from ckptd.agent.client import AgentClient, AgentStorage, HeldStorage
from ckptd.coordinator import planning
from ckptd.coordinator.types import SaveRef
from ckptd.errors import CkptError, SaveFailed
from ckptd.format import layout
from ckptd.format.writer import ShardWriteStats
from ckptd.server.client import CoordinatorClient
from ckptd.storage import Storage
from ckptd.storage.local import LocalStorage

log = logging.getLogger("ckpt")

TOKEN_FILE = ".ckptd-agent-token"
_STARTED: list[subprocess.Popen[bytes]] = []
AGENT_FILE = "agent.json"


@dataclasses.dataclass(frozen=True)
class MemoryTier:
    """How a Checkpointer keeps checkpoints in memory (docs/memory-tier.md).

    every: maybe_save takes a memory checkpoint every `every` steps (a step that is also
        a persistent one goes to storage instead).
    replicas: copies on other nodes (the next ones of the ring by node index).
    max_steps, max_bytes: each agent's budget (oldest steps evicted, never the newest
        committed; a shard that cannot fit is refused and the save reported).
    root: this node's shared-memory directory; default $CKPTD_MEMORY_ROOT, else
        /dev/shm/ckptd-<job directory name>-<hash of its path>.
    node, nodes: this node's index and the node count; default from torchrun
        (GROUP_RANK, WORLD_SIZE / LOCAL_WORLD_SIZE), else one node.
    host: the address this node's agent listens on; default $CKPTD_AGENT_HOST, else this
        host's name.
    timeout_s: how long a memory save waits for the other ranks before giving up on it.
    """

    every: int
    replicas: int = 1
    max_steps: int | None = 2
    max_bytes: int | None = None
    root: str | None = None
    node: int | None = None
    nodes: int | None = None
    host: str | None = None
    timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if self.every < 1:
            raise ValueError(f"MemoryTier.every must be at least 1, got {self.every}")
        if self.replicas < 0:
            raise ValueError(f"MemoryTier.replicas must be >= 0, got {self.replicas}")
        if self.max_steps is not None and self.max_steps < 2:
            raise ValueError(
                f"MemoryTier.max_steps must be at least 2 (the newest committed step stays "
                f"while the next one is written), got {self.max_steps}"
            )
        if self.max_bytes is not None and self.max_bytes < 1:
            raise ValueError(f"MemoryTier.max_bytes must be positive, got {self.max_bytes}")


def _placement(tier: MemoryTier, rank: int, world_size: int) -> tuple[int, int]:
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0) or world_size
    nodes = tier.nodes or max(1, world_size // local)
    node = tier.node
    if node is None:
        group = os.environ.get("GROUP_RANK")
        node = int(group) if group is not None else rank // local
    if not 0 <= node < nodes:
        raise ValueError(f"memory tier: node {node} is not in [0, {nodes})")
    return node, nodes


def default_root(path: str) -> str:
    env = os.environ.get("CKPTD_MEMORY_ROOT")
    if env:
        return env
    name = "".join(c if c.isalnum() or c in "._-" else "_" for c in os.path.basename(path))
    return f"/dev/shm/ckptd-{name[:64]}-{zlib.crc32(path.encode()):08x}"


def job_token(storage: Storage, token: str | None) -> str:
    """The agents' token: the job's, else one random secret kept in the job directory."""
    token = token or os.environ.get("CKPTD_TOKEN")
    if token:
        return token
    try:
        storage.create_only(TOKEN_FILE, secrets.token_hex(16).encode())
    except CkptError:
        pass  # another rank (or an earlier attempt) made it: everyone reads the same one
    return storage.read_bytes(TOKEN_FILE, limit=256).decode().strip()


def ensure_agent(root: str, node: int, token: str, tier: MemoryTier) -> AgentClient:
    """This node's agent: the one that answers, or a new one started here (under the
    root's lock file, so one rank of the node starts it)."""
    os.makedirs(root, mode=0o700, exist_ok=True)
    info_path = os.path.join(root, AGENT_FILE)
    with open(os.path.join(root, "agent.lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        client = _answering(info_path, token)
        if client is not None:
            return client
        if os.path.exists(info_path):
            os.unlink(info_path)
        host = tier.host or os.environ.get("CKPTD_AGENT_HOST") or socket.gethostname()
        argv = [sys.executable, "-m", "ckptd.cli.serve", "agent", "--root", root]
        argv += ["--node", str(node), "--listen", f"{host}:0"]
        if tier.max_steps is not None:
            argv += ["--max-steps", str(tier.max_steps)]
        if tier.max_bytes is not None:
            argv += ["--max-bytes", str(tier.max_bytes)]
        with open(os.path.join(root, "agent.log"), "ab") as out:
            proc = subprocess.Popen(  # noqa: S603 - our own module, fixed arguments
                argv,
                env=dict(os.environ, CKPTD_TOKEN=token),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                start_new_session=True,  # outlives this rank (and its process group's signals)
                close_fds=True,
            )
        _STARTED.append(proc)  # it outlives this process: never reaped, never collected
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            client = _answering(info_path, token)
            if client is not None:
                log.info("memory tier: started agent pid %d for node %d (%s)", proc.pid, node, root)
                return client
            if proc.poll() is not None:
                break
            time.sleep(0.05)
        raise SaveFailed(
            f"memory tier: the agent for node {node} did not start (see {root}/agent.log)"
        )


def _answering(info_path: str, token: str) -> AgentClient | None:
    try:
        with open(info_path) as f:
            info = json.load(f)
        client = AgentClient(str(info["address"]), token, timeout_s=600)
        client.call("ping", "memory agent")
        return client
    except (OSError, ValueError, KeyError, CkptError):
        return None


class MemorySaver:
    """One rank's memory saves and memory tiers (the module docstring)."""

    def __init__(
        self,
        tier: MemoryTier,
        path: str,
        storage: Storage,
        store: Any,
        token: str | None,
        rank_world: tuple[int, int],
        generation_attempt: tuple[int, str],
        *,
        client: CoordinatorClient,
        allow_divergent: bool = False,
        image: HostImage | None = None,
        persisting: Callable[[], bool] | None = None,
    ):
        """path, storage: the job's; store: the process group's (None for one rank);
        client: the coordinator's (it commits memory steps: ckptd.coordinator.memory);
        image: the Checkpointer's staging image, which a memory save stages into unless
        `persisting()` (a persistent save is being written from it)."""
        rank, world_size = rank_world
        self.tier, self.path, self.rank, self.world_size = tier, path, rank, world_size
        self.generation, self.attempt = generation_attempt
        self.store, self.client, self.allow_divergent = store, client, allow_divergent
        self.node, self.nodes = _placement(tier, rank, world_size)
        if world_size > 1 and store is None:
            raise ValueError(
                "memory tier: several ranks need a torch.distributed process group (its "
                "store is how their memory saves agree)"
            )
        self.root = tier.root or default_root(path)
        self._key = f"ckptd/memory/{path}/{self.attempt}"
        if store is None or rank == 0:
            self.token = job_token(storage, token)
            if store is not None:  # as the coordinator's token is (ckpt._connect)
                store.set(f"{self._key}/token", self.token)
        else:
            store.wait([f"{self._key}/token"], datetime.timedelta(seconds=tier.timeout_s))
            self.token = store.get(f"{self._key}/token").decode()
        self.agent = ensure_agent(self.root, self.node, self.token, tier)
        self.storage = LocalStorage(self.root, direct_io=False, early_writeback=False)
        if store is not None:
            store.set(f"{self._key}/agent/{self.node}", self.agent.address)
        self._peers: dict[int, AgentClient] = {}
        # Staging: the Checkpointer's image when no persistent save is being written out
        # of it, else a spare of this saver's, unmapped once the save is placed. So a rank
        # holds one image of its state, two only while the two kinds of save overlap
        # (they never wait for each other); `holds_shared` tells the persistent save.
        self._shared, self._persisting = image, persisting
        self._spare = HostImage()
        self._staged_in: HostImage | None = None
        self.holds_shared = False
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="ckpt-memory")
        self._inflight: PendingSave | None = None
        self._solo: dict[str, dict[str, Any]] = {}  # one rank: what it would post

    @property
    def url(self) -> str:
        """What the catalog records as the memory tier's place: the ring's agents."""
        return f"agent://node{self.node}{self.root}"

    # -- placement -----------------------------------------------------------------------
    def ring(self) -> list[int]:
        """The nodes that hold copies of this node's shards (the next ones of the ring)."""
        n = min(self.tier.replicas, self.nodes - 1)
        return [(self.node + k) % self.nodes for k in range(1, n + 1)]

    def agent_of(self, node: int) -> AgentClient:
        if node == self.node:
            return self.agent
        if node not in self._peers:
            assert self.store is not None
            key = f"{self._key}/agent/{node}"
            self.store.wait([key], datetime.timedelta(seconds=self.tier.timeout_s))
            address = self.store.get(key).decode()
            self._peers[node] = AgentClient(address, self.token, timeout_s=600)
        return self._peers[node]

    def tiers(self) -> list[tuple[str, Storage]]:
        """The memory tiers, nearest first: this node's memory ("memory": the steps this
        node committed, each file read here when held here, else from its holder), then
        the other nodes' ("peer": the steps any of them holds, read from them alone, so a
        bad local copy falls through to theirs). Peers go in ring order from this node's
        successor, which holds this node's shards."""
        others: list[AgentStorage] = []
        for k in range(1, self.nodes):
            node = (self.node + k) % self.nodes
            try:
                others.append(AgentStorage(self.agent_of(node), node=node))
            except (CkptError, OSError, RuntimeError) as e:
                log.warning("memory tier: node %d's agent is unknown (%s); skipping it", node, e)
        away = [o.node for o in others]
        out: list[tuple[str, Storage]] = [
            (
                "memory",
                HeldStorage(
                    [self.storage, *others],
                    nodes=[self.node, *away],
                    home=self.node,
                    listed=1,
                    url=self.storage.url,
                ),
            )
        ]
        if others:
            out.append(("peer", HeldStorage(list(others), nodes=away, home=self.node)))
        return out

    # -- save ----------------------------------------------------------------------------
    def save(
        self,
        state: Any,
        step: int,
        *,
        parent: int | None,
        metadata: dict[str, Any],
        after: PendingSave | None = None,
    ) -> PendingSave:
        """Stage `state` (the blocking part) and place it in memory in the background.

        after: the persistent save still in flight that this step descends from; the
        memory commit waits for it, since the live line orders steps by commit time (a
        parent committed after its child would put the child on an abandoned branch)."""
        prev = self._inflight
        if prev is not None and not prev.done():
            log.warning(
                "job %s step %d: memory save skipped, step %d is still being placed",
                self.path,
                step,
                prev.step,
            )
            self._post(step, "plan", {"skip": True})
            return PendingSave(step, skipped=True)
        with GcClock() as collector:
            t0 = time.perf_counter()
            busy = self._shared is None or (self._persisting is not None and self._persisting())
            image = self._spare if busy else self._shared
            assert image is not None
            self._staged_in, self.holds_shared = image, not busy
            try:
                node, leaves = flatten(state, rank=self.rank, keep_device=True)
                ref = SaveRef(self.path, step, self.generation, self.rank, self.world_size)
                job = SaveJob(
                    self.storage, ref, node, metadata, SaveOptions(verify="size"), leaves, image
                )
            except BaseException:
                self._free_image()
                raise
        del leaves
        pending = PendingSave(step)
        pending.timings.blocking_s = pending.timings.staging_s = time.perf_counter() - t0
        pending.timings.gc_s = collector.s
        pending.bytes = job.held_bytes
        self._inflight = pending
        self._worker.submit(self._place, job, pending, parent, after)
        return pending

    def _place(
        self, job: SaveJob, pending: PendingSave, parent: int | None, after: PendingSave | None
    ) -> None:
        t0 = time.perf_counter()
        try:
            self._place_or_raise(job, parent, after)
        except BaseException as e:  # noqa: BLE001 - reported, never raised into training
            self._free_image()
            pending.timings.persist_s = time.perf_counter() - t0
            log.error(
                "job %s step %d rank %d: MEMORY SAVE NOT PLACED (%s: %s); training goes on, "
                "the next persistent save is unaffected",
                self.path,
                job.step,
                self.rank,
                type(e).__name__,
                e,
            )
            job.abort()
            pending.settle(None, e)
            pending.take_unseen_error()  # reported here: the training loop is not raised at
            return
        pending.timings.persist_s = time.perf_counter() - t0
        self._free_image()
        pending.settle(
            SaveResult(
                step=job.step,
                path=f"{self.storage.url}/{layout.step_dir(job.step)}",
                bytes=job.written_bytes(job.assigned or []),
                seconds=pending.timings.blocking_s + pending.timings.persist_s,
                staging_s=pending.timings.staging_s,
                gc_s=pending.timings.gc_s,
                blocking_s=pending.timings.blocking_s,
                persist_s=pending.timings.persist_s,
            ),
            None,
        )

    def _place_or_raise(self, job: SaveJob, parent: int | None, after: PendingSave | None) -> None:
        step = job.step
        ref = SaveRef(self.path, step, self.generation, self.rank, self.world_size)
        save = MemoryRankSave(self.client, ref, timeout_s=self.tier.timeout_s)
        save.join()
        with save.leased():
            manifest = self._place_leased(job, parent, after, save)
        # Committed: each rank writes the manifest into its own node's agent (the same
        # bytes from every rank of a node: the agent keeps one).
        try:
            self.agent.call("commit", f"job {self.path!r} step {step}", [manifest], step=step)
        except (CkptError, OSError) as e:
            log.error(
                "job %s step %d: the memory step is committed, but node %d's agent did not "
                "take its manifest (%s): this node's memory lacks it, the peers have it",
                self.path,
                step,
                self.node,
                e,
            )
            return
        if self.rank == 0:
            log.info("job %s step %d: memory checkpoint committed", self.path, step)
            self._forget(step)  # every rank has read every plan: all reported "held"

    def _place_leased(
        self, job: SaveJob, parent: int | None, after: PendingSave | None, save: MemoryRankSave
    ) -> bytes:
        step = job.step
        digests = job.digests()
        plan = job.plan(digests)
        self._post(step, "plan", {"plan": [dataclasses.asdict(c) for c in plan], "state": job.node})
        plans = {}
        for r, doc in self._gather(step, "plan").items():
            if doc.get("skip"):
                raise SaveFailed(
                    f"job {self.path!r} step {step}: rank {r} skipped this memory save"
                )
            plans[r] = [planning.ChunkPlan(**_tuples(c)) for c in doc["plan"]]
        write = planning.assign(plans, allow_divergent=self.allow_divergent).write.get(
            self.rank, []
        )
        size = job.shard_size(write)
        names = [
            layout.shard_name(self.rank, self.generation),
            layout.index_name(self.rank, self.generation),
        ]
        self.agent.call(
            "prepare",
            f"job {self.path!r} step {step} rank {self.rank}",
            step=step,
            files=names,
            size=size,
        )
        try:
            info = job.write(write, digests, ShardWriteStats())
        except BaseException:
            self.agent.call("release", "memory agent", step=step, files=names)
            raise
        self._free_image()  # written out: a persistent save may stage into it now
        peers = [self.agent_of(n).address for n in self.ring()]
        reply, _ = self.agent.call(
            "seal",
            f"job {self.path!r} step {step} rank {self.rank}",
            step=step,
            shard=info.to_json(),
            replicas=peers,
        )
        for failure in reply["failures"]:
            log.error("job %s step %d rank %d: %s", self.path, step, self.rank, failure)
        if after is not None:
            # The live line orders steps by commit time: the persistent save this step
            # descends from commits first.
            after.join()
        k = knobs.get()
        return save.commit(
            {
                "shard": info.to_json(),
                "held": reply["held"],
                "node": self.node,
                "nodes": self.nodes,
                "copies": self.copies,
                "block_size": k.block_size,
                "alignment": k.alignment,
                "state": job.node,
                "metadata": job.metadata if self.rank == 0 else {},
                "parent": parent,
                "url": self.url,
            }
        )

    @property
    def copies(self) -> int:
        """How many nodes must hold each shard for the coordinator to commit the step: two
        (the loss of any one node leaves a copy), or one without replicas or nodes."""
        return min(2, self.nodes) if self.tier.replicas > 0 else 1

    # -- the store: what the ranks of one memory save tell each other ---------------------
    def _post(self, step: int, what: str, doc: dict[str, Any]) -> None:
        if self.store is not None:
            self.store.set(f"{self._key}/{step}/{what}/{self.rank}", json.dumps(doc))
        else:
            self._solo[what] = doc

    def _gather(self, step: int, what: str) -> dict[int, dict[str, Any]]:
        if self.store is None:
            return {0: self._solo.pop(what)}
        keys = [f"{self._key}/{step}/{what}/{r}" for r in range(self.world_size)]
        try:
            self.store.wait(keys, datetime.timedelta(seconds=self.tier.timeout_s))
        except RuntimeError as e:
            missing = [r for r, key in enumerate(keys) if not self.store.check([key])]
            raise SaveFailed(
                f"job {self.path!r} step {step}: ranks {missing} did not reach the memory "
                f"save within {self.tier.timeout_s:.0f} s ({e})"
            ) from None
        return {r: json.loads(self.store.get(key)) for r, key in enumerate(keys)}

    def _forget(self, step: int) -> None:
        if self.store is None:
            return
        for what in ("plan",):
            for r in range(self.world_size):
                try:
                    self.store.delete_key(f"{self._key}/{step}/{what}/{r}")
                except (RuntimeError, AttributeError):
                    return

    def _free_image(self) -> None:
        """The staged bytes are written out (or the save failed): hand the shared image
        back, or unmap the spare (freed once the save's last view of it goes)."""
        image, self._staged_in = self._staged_in, None
        self.holds_shared = False
        if image is not None and image is not self._shared:
            image.release()

    def wait(self) -> None:
        p = self._inflight
        if p is not None:
            p.join()

    def close(self) -> None:
        self.wait()
        self._worker.shutdown(wait=True)
        self._spare.release()
        self.agent.close()
        for c in self._peers.values():
            c.close()


def _tuples(c: dict[str, Any]) -> dict[str, Any]:
    return {k: tuple(v) if isinstance(v, list) else v for k, v in c.items()}
