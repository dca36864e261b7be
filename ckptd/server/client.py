"""The gRPC client of the coordinator: deadlines, retries, errors that name the save.

Used by the training-loop library (`ckpt`) and by `ckptctl`. Callers get the coordinator's
own types (SaveRef, BeginResult, StatusResult, SaveRecord), never protobuf messages: the
wire stays inside ckptd.server (converters.py).

Synchronous on purpose: a training process has no event loop of its own to lend, and
every call here is a short control message. UNAVAILABLE (coordinator restarting, network
blip) is retried with exponential backoff for a window that depends on what this client
has seen, never for a call's own (long) deadline: a coordinator never reached in this
client's life gets `connect_retry_s` (a mistyped address or a server that is not running
fails within seconds); one that answered before gets about the lease (`retry_for_s`, then
the lease the coordinator granted): a restart within that window is ridden out, and after
it the ranks' leases have expired, so the save is lost anyway. Every other failure becomes
the ckptd error the server named in the call's metadata (errors.py), prefixed with job,
step and rank.

Several addresses ("a:7070,b:7070", as CKPTD_ADDRESS may give them: coordinators on one
PostgreSQL catalog, one leading and the others standing by) are tried in turn: a call
answered UNAVAILABLE (a standby says so, a dead leader cannot answer) goes at once to the
next address, and only after every address was tried does the client back off; the
address that answered is kept for the calls after it. So does a call whose deadline
passed (a frozen leader, or one whose host vanished, answers nothing; every call of the
protocol may be sent again). The retry window is the same.

A call cut off by the coordinator's side with CANCELLED is one it did not answer either:
a server that stops cancels the calls in flight on it (a standby handing its address to
the leader it became, a coordinator restarting), and gRPC reports a connection that ends
mid-call as CANCELLED or UNAVAILABLE depending on when. This client never cancels a call
it still waits for, except by `close`, so a CANCELLED it did not cause is retried as
UNAVAILABLE is. Which failures are sent again is decided in one place, `sends_again`.
"""

from __future__ import annotations

import json
import random
import re
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import grpc

from ckptd.coordinator.catalog import SaveRecord
from ckptd.coordinator.layouts import layout_digest
from ckptd.coordinator.planning import ChunkPlan
from ckptd.coordinator.types import BeginResult, SaveRef, ShardReport, StatusResult
from ckptd.errors import CkptError, CoordinatorUnavailable, LayoutUnknown
from ckptd.server import converters as cv
from ckptd.server.errors import error_from
from ckptd.v1 import coordinator_pb2 as pb
from ckptd.v1 import coordinator_pb2_grpc as pb_grpc

T = TypeVar("T")
PLAN_PART_CHUNKS = 10_000  # ~1-1.5 MiB per BeginSave part, well under the 4 MiB default
# The statuses of a call the coordinator did not answer (see the module docstring): down,
# restarting, standing by or the network dropped (UNAVAILABLE); stopping, or a connection
# that ended mid-call (CANCELLED that this client did not cause); frozen or vanished
# (DEADLINE_EXCEEDED). The client's `sends_again` decides which it retries, the node
# session hands them to it.
UNANSWERED = (
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.DEADLINE_EXCEEDED,
)
REPORT_DEADLINE_S = 120.0  # a report's checks are the coordinator's own I/O, never a wait
AWAIT_COMMIT_S = 600.0  # an AwaitCommit that names no timeout waits this long


def barrier_deadline_s(reqs: Sequence[pb.BeginSaveRequest]) -> float | None:
    """A node's BeginSaveNode deadline: its ranks' barrier timeout and 30 s for the answer
    (None: the call's default), by unary call or on the node session."""
    wait = max((r.timeout_ms for r in reqs), default=0) / 1000
    return wait + 30 if wait else None


def parse_addresses(address: str) -> list[str]:
    """The coordinator addresses in `address` ("host:port", or several, comma-separated)."""
    out = [a.strip() for a in address.split(",") if a.strip()]
    if not out:
        raise CkptError(
            f"coordinator address {address!r} names no host:port; set CKPTD_ADDRESS (or "
            "coordinator=, or ckptctl --coordinator) to HOST:PORT, or to several, "
            "comma-separated (a leader and its standbys)"
        )
    return out


class _Rotating:
    """The stub of whichever address is current: `stub.Method(...)` resolves the method
    when called, so a retry after a switch of address goes to the new one."""

    def __init__(self, client: CoordinatorClient):
        self._client = client

    def __getattr__(self, name: str) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            return getattr(self._client.current_stub(), name)(*args, **kwargs)

        return call


class CoordinatorClient:
    def __init__(
        self,
        address: str,
        *,
        token: str | None = None,
        root_certificates: bytes | None = None,
        client_cert: tuple[bytes, bytes] | None = None,  # (key, cert) for mutual TLS
        call_timeout_s: float = 30.0,
        retry_for_s: float = 60.0,
        connect_retry_s: float = 10.0,
    ):
        self.address = address
        self.addresses = parse_addresses(address)
        self.tls = root_certificates is not None or client_cert is not None
        opts = [
            ("grpc.max_receive_message_length", 8 << 20),
            ("grpc.max_send_message_length", 8 << 20),
            ("grpc.enable_retries", 0),  # retries are ours, with deadlines that know the save
            # A channel whose coordinator is down fails calls at once until its next
            # reconnect attempt, and gRPC spaces those 1 s, 1.6 s, ... up to 120 s apart: a
            # coordinator back after 8 s was seen only after 9-10 s, past a rank's
            # connect_retry_s, and one down for a minute up to two minutes later. Tried
            # at least every second, a restart is seen within the retry window it meets.
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.min_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 1000),
        ]
        self._creds: grpc.ChannelCredentials | None = None
        self._opts = opts
        if root_certificates is not None or client_cert is not None:
            self._creds = creds = grpc.ssl_channel_credentials(
                root_certificates=root_certificates,
                private_key=client_cert[0] if client_cert else None,
                certificate_chain=client_cert[1] if client_cert else None,
            )
            self._channels = [grpc.secure_channel(a, creds, options=opts) for a in self.addresses]
        else:
            self._channels = [grpc.insecure_channel(a, options=opts) for a in self.addresses]
        self._stubs = [pb_grpc.CoordinatorStub(c) for c in self._channels]
        self._current = 0  # the address that answered last
        self._stub: Any = _Rotating(self)
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self.call_timeout_s = call_timeout_s
        self.retry_for_s = retry_for_s
        self.connect_retry_s = connect_retry_s
        self.reached = False  # has the coordinator ever answered this client?
        self.closed = False  # close() was called: its channels cancel the calls in flight
        self.lease_s: float | None = None  # the lease it granted, once a save began
        # Per (job, rank): the layout digest of the last plan the coordinator accepted,
        # so an unchanged layout is sent as a cached plan (ckptd.coordinator.layouts).
        self.layouts: dict[tuple[str, int], bytes] = {}

    def retry_window_s(self) -> float:
        """How long UNAVAILABLE is retried (see the module docstring)."""
        if not self.reached:
            return self.connect_retry_s
        return self.lease_s if self.lease_s is not None else self.retry_for_s

    def unavailable(self, what: str, why: str) -> CoordinatorUnavailable:
        """The error for a coordinator that cannot be reached, saying what to check."""
        tls = (
            "that it serves TLS and tls_root_cert is its CA (with a client certificate its CA "
            "signed, for mutual TLS)"
            if self.tls
            else "whether it is a TLS server (then pass tls_root_cert, --tls-root-cert)"
        )
        seen = (
            "it answered before: it died, restarted for too long or the network dropped"
            if self.reached
            else f"it never answered this process (tried for {self.connect_retry_s:.0f} s)"
        )
        return CoordinatorUnavailable(
            f"{what}: coordinator {self.address} unreachable or too slow ({why}); {seen}. "
            "Check the address (CKPTD_ADDRESS, coordinator=, or ckptctl --coordinator), that "
            "the process hosting it (`ckptd serve`, or rank 0 for a zero-config job) runs and "
            f"this host can reach it, and {tls}"
        )

    def close(self) -> None:
        self.closed = True
        for c in self._channels:
            c.close()

    def aio_channel(self, address: str) -> grpc.aio.Channel:
        """A grpc.aio channel to `address` with this client's credentials and options, for
        a node aggregator's session stream (ckptd.server.node_session); made on, and closed
        by, the event loop that uses it."""
        if self._creds is not None:
            return grpc.aio.secure_channel(address, self._creds, options=self._opts)
        return grpc.aio.insecure_channel(address, options=self._opts)

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    def note_lease(self, answers: Sequence[pb.BeginSaveResponse]) -> None:
        """The lease a BeginSave answer granted: the retry window of later calls."""
        for b in answers:
            if b.lease_ms > 0:
                self.lease_s = b.lease_ms / 1000

    def unanswered(self, code: grpc.StatusCode) -> bool:
        """Whether a call that failed with `code` went unanswered (UNANSWERED): not an error
        the coordinator answered, nor a call this client cancelled itself (CANCELLED after
        close(), whose channels cancel the calls in flight)."""
        return code in UNANSWERED and not (code == grpc.StatusCode.CANCELLED and self.closed)

    def sends_again(self, code: grpc.StatusCode) -> bool:
        """Whether a call that failed with `code` is sent again (to the next address, or
        after a backoff, within the retry window): the one rule of this client.

        Every call of the protocol may be sent again: the coordinator answers a repeated
        call as it did the first (a report it holds, a save that ended: Coordinator._find,
        from the catalog after a restart or a takeover). So an unanswered call is sent
        again, except one whose deadline passed when there is one address: that
        coordinator is frozen or gone, and asking it again would wait as long again.
        """
        if code == grpc.StatusCode.DEADLINE_EXCEEDED and len(self.addresses) == 1:
            return False
        return self.unanswered(code)

    def current_stub(self) -> pb_grpc.CoordinatorStub:
        return self._stubs[self._current]

    @property
    def current_address(self) -> str:
        return self.addresses[self._current]

    def _call(
        self, what: str, fn: Callable[..., T], request: Any, *, timeout_s: float | None = None
    ) -> T:
        timeout = timeout_s or self.call_timeout_s
        give_up: float | None = None
        delay = 0.05
        untried = len(self.addresses) - 1  # addresses left to try before backing off
        while True:
            try:
                r = fn(request, timeout=timeout, metadata=self._metadata)
                self.reached = True
                return r
            except grpc.RpcError as e:
                code = e.code()
                details = e.details() or str(code)
                if len(self.addresses) > 1:
                    details = f"{self.current_address}: {details}"
                # The window opens at the first failure: a barrier wait of minutes that the
                # coordinator's death cut short gets the whole window to find it again.
                if self.sends_again(code):
                    if give_up is None:
                        give_up = time.monotonic() + self.retry_window_s()
                    if len(self.addresses) > 1:
                        self._current = (self._current + 1) % len(self.addresses)
                        if untried > 0:
                            untried -= 1
                            continue
                        untried = len(self.addresses) - 1
                    if time.monotonic() + delay < give_up:
                        time.sleep(delay * (0.5 + random.random()))  # noqa: S311 - jitter
                        delay = min(delay * 2, 2.0)
                        continue
                if self.unanswered(code):
                    raise self.unavailable(what, f"{code.name}: {details}") from None
                self.reached = True  # it answered, with an error of its own
                trailers = e.trailing_metadata() if isinstance(e, grpc.Call) else None
                msg = named_once(what, details)
                raise error_from(code, msg, trailers, where=self.address) from None

    # -- RPCs --------------------------------------------------------------------------
    def open_job(self, job: str, attempt: str) -> tuple[int, str]:
        r = self._call(
            f"job {job!r}", self._stub.OpenJob, pb.OpenJobRequest(job=job, attempt=attempt)
        )
        return r.generation, r.job

    def begin_save(
        self,
        ref: SaveRef,
        chunks: Sequence[ChunkPlan],
        *,
        state: Any,
        metadata: dict[str, Any] | None,
        allow_divergent: bool,
        keep_last: int,
        timeout_s: float,
        parent: int | None = None,
    ) -> BeginResult:
        """BeginSave with the rank's plan, in parts. A plan whose layout the coordinator
        accepted from this rank last time goes as a cached plan (the layout's digest and
        the chunks' digests); a coordinator that no longer holds it (restarted) answers
        LayoutUnknown and gets the whole plan, once."""
        layout = layout_digest(chunks) if chunks else b""
        key = (ref.job, ref.rank)
        shared_state, rank_state = cv.state_fields(state)
        common = dict(
            state=shared_state,
            rank_state=rank_state,
            metadata=json.dumps(metadata or {}).encode(),
            allow_divergent_replicas=allow_divergent,
            keep_last=keep_last,
            timeout_ms=int(timeout_s * 1000),
            parent=parent,
        )

        def send(cached: bool) -> pb.BeginSaveResponse:
            return self._begin_parts(ref, chunks, layout, common, timeout_s, cached=cached)

        r = None
        if layout and self.layouts.get(key) == layout:
            try:
                r = send(cached=True)
            except LayoutUnknown:
                self.layouts.pop(key, None)
        if r is None:
            r = send(cached=False)
        if not r.complete:
            raise CkptError(f"{_what(ref)}: the coordinator did not accept the whole plan")
        if layout:
            self.layouts[key] = layout
        begun = cv.begin_from_pb(r)
        if begun.lease_s > 0:
            self.lease_s = begun.lease_s
        return begun

    # -- the node aggregator's calls (ckptd.server.node): it forwards wire messages --------
    def begin_save_pb(self, req: pb.BeginSaveRequest) -> pb.BeginSaveResponse:
        last = req.part + 1 >= max(1, req.parts)
        wait = req.timeout_ms / 1000 + 30 if last and req.timeout_ms else None
        return self._call(what_pb(req.ref), self._stub.BeginSave, req, timeout_s=wait)

    def begin_save_node(
        self, node: str, reqs: Sequence[pb.BeginSaveRequest]
    ) -> list[pb.BeginSaveResponse]:
        """The node's last BeginSave parts in one call; it waits at the barrier."""
        r = self._call(
            what_node(node, [q.ref for q in reqs]),
            self._stub.BeginSaveNode,
            pb.NodeBeginSaveRequest(node=node, ranks=reqs),
            timeout_s=barrier_deadline_s(reqs),
        )
        self.note_lease(r.ranks)
        return list(r.ranks)

    def keep_alive_node(
        self, node: str, reqs: Sequence[pb.KeepAliveRequest]
    ) -> list[pb.SaveStatus]:
        what = what_node(node, [q.ref for q in reqs])
        req = pb.NodeKeepAliveRequest(node=node, ranks=reqs)
        return list(self._call(what, self._stub.KeepAliveNode, req).ranks)

    def report_shards_node(
        self, node: str, reqs: Sequence[pb.ReportShardRequest]
    ) -> list[pb.SaveStatus]:
        what = what_node(node, [q.ref for q in reqs])
        req = pb.NodeReportRequest(node=node, ranks=reqs)
        return list(
            self._call(what, self._stub.ReportShardsNode, req, timeout_s=REPORT_DEADLINE_S).ranks
        )

    def await_commit_pb(self, req: pb.AwaitCommitRequest) -> pb.SaveStatus:
        ref = cv.ref_from_pb(req.ref)
        return cv.status_to_pb(self.await_commit(ref, req.timeout_ms / 1000 or AWAIT_COMMIT_S))

    def abort_save_pb(self, req: pb.AbortSaveRequest) -> pb.SaveStatus:
        return self._call(what_pb(req.ref), self._stub.AbortSave, req, timeout_s=10)

    def _begin_parts(
        self,
        ref: SaveRef,
        chunks: Sequence[ChunkPlan],
        layout: bytes,
        common: dict[str, Any],
        timeout_s: float,
        *,
        cached: bool,
    ) -> pb.BeginSaveResponse:
        """Every part of one BeginSave; the answer to the last (which waits at the barrier)."""
        parts = max(1, -(-len(chunks) // PLAN_PART_CHUNKS))
        r = None
        for part in range(parts):
            last = part == parts - 1
            mine = chunks[part * PLAN_PART_CHUNKS : (part + 1) * PLAN_PART_CHUNKS]
            req = pb.BeginSaveRequest(
                ref=cv.ref_to_pb(ref),
                chunks=[] if cached else [cv.chunk_to_pb(c) for c in mine],
                digests=b"".join(bytes.fromhex(c.blake3) for c in mine) if cached else b"",
                layout_digest=layout,
                part=part,
                parts=parts,
                **(
                    common if last else {**common, "state": b"", "rank_state": b"", "metadata": b""}
                ),
            )
            r = self._call(
                _what(ref), self._stub.BeginSave, req, timeout_s=timeout_s + 30 if last else None
            )
        assert r is not None
        return r

    def keep_alive(self, ref: SaveRef) -> StatusResult:
        return cv.status_from_pb(
            self._call(_what(ref), self._stub.KeepAlive, pb.KeepAliveRequest(ref=cv.ref_to_pb(ref)))
        )

    def report_shard(self, ref: SaveRef, report: ShardReport) -> StatusResult:
        req = cv.report_to_pb(cv.ref_to_pb(ref), report)
        return cv.status_from_pb(
            self._call(_what(ref), self._stub.ReportShard, req, timeout_s=REPORT_DEADLINE_S)
        )

    def await_commit(self, ref: SaveRef, timeout_s: float) -> StatusResult:
        """AwaitCommit, in slices of about half the lease: each slice's deadline is short, so
        a coordinator that died (or a host that vanished without closing the connection) is
        noticed within about a lease, not at the end of the save's whole timeout; each
        slice also tells the coordinator that this rank still waits."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = max(0.001, deadline - time.monotonic())
            wait = min(left, min(max(1.0, (self.lease_s or 20.0) / 2), 30.0))
            req = pb.AwaitCommitRequest(ref=cv.ref_to_pb(ref), timeout_ms=max(1, int(wait * 1000)))
            st = cv.status_from_pb(
                # Twice the slice: a coordinator busy for seconds is not taken for a dead one.
                self._call(_what(ref), self._stub.AwaitCommit, req, timeout_s=2 * wait + 5)
            )
            if st.status in ("COMMITTED", "ABORTED") or wait >= left:
                return st

    def abort_save(self, ref: SaveRef, reason: str) -> StatusResult:
        req = pb.AbortSaveRequest(ref=cv.ref_to_pb(ref), reason=reason[:2000])
        return cv.status_from_pb(self._call(_what(ref), self._stub.AbortSave, req, timeout_s=10))

    def list_checkpoints(self, job: str) -> list[SaveRecord]:
        r = self._call(
            f"job {job!r}", self._stub.ListCheckpoints, pb.ListCheckpointsRequest(job=job)
        )
        return [cv.record_from_pb(i) for i in r.checkpoints]

    def get_checkpoint(self, job: str, step: int | None = None) -> SaveRecord:
        req = (
            pb.GetCheckpointRequest(job=job, step=step)
            if step is not None
            else pb.GetCheckpointRequest(job=job, latest=True)
        )
        what = f"job {job!r}" + (f" step {step}" if step is not None else "")
        return cv.record_from_pb(self._call(what, self._stub.GetCheckpoint, req))

    def quarantine(self, job: str, step: int, reason: str) -> SaveRecord:
        req = pb.QuarantineRequest(job=job, step=step, reason=reason[:4000])
        return cv.record_from_pb(
            self._call(f"job {job!r} step {step}", self._stub.Quarantine, req, timeout_s=30)
        )

    def record_tier(
        self, job: str, step: int, tier: str, url: str, status: str, reason: str = ""
    ) -> None:
        req = pb.RecordTierRequest(
            job=job, step=step, tier=tier, url=url, status=status, reason=reason[:4000]
        )
        self._call(f"job {job!r} step {step} tier {tier}", self._stub.RecordTier, req)

    def memory_save(
        self,
        ref: SaveRef,
        phase: str,
        report: dict[str, Any] | None = None,
        *,
        timeout_s: float = 0.0,
        reason: str = "",
    ) -> tuple[StatusResult, bytes]:
        """One phase of a rank's memory save (ckptd.coordinator.memory): its status, and
        the step's manifest once COMMITTED."""
        req = pb.MemorySaveRequest(
            ref=cv.ref_to_pb(ref),
            phase=phase,
            report=json.dumps(report, separators=(",", ":")).encode() if report else b"",
            timeout_ms=max(0, int(timeout_s * 1000)),
            reason=reason[:2000],
        )
        wait = timeout_s + 30 if phase in ("await", "held") else None
        r = self._call(f"{_what(ref)} (memory {phase})", self._stub.MemorySave, req, timeout_s=wait)
        if r.lease_ms > 0:
            self.lease_s = r.lease_ms / 1000
        return cv.status_from_pb(r.status), r.manifest


_SAVE_HEAD = re.compile(r"job .*? step -?\d+")


def named_once(what: str, details: str) -> str:
    """`what: details`, without the job and step a second time when the server's message
    starts with them too (an error passed on through a node's aggregator would otherwise
    repeat "job ... step ..." once per hop)."""
    head = _SAVE_HEAD.match(what)
    if head is not None:
        h = head.group(0)
        if details.startswith(h) and details[len(h) : len(h) + 1] in (" ", ":"):
            details = details[len(h) :].lstrip(" :")
    return f"{what}: {details}"


def _what(ref: SaveRef) -> str:
    return f"job {ref.job!r} step {ref.step} rank {ref.rank}/{ref.world_size} generation {ref.generation}"


def what_pb(ref: pb.SaveRef) -> str:
    return _what(cv.ref_from_pb(ref))


def what_node(node: str, refs: Sequence[pb.SaveRef]) -> str:
    if not refs:
        return f"node {node!r}"
    r = refs[0]
    ranks = ",".join(str(x.rank) for x in refs[:16]) + ("..." if len(refs) > 16 else "")
    return f"job {r.job!r} step {r.step} node {node!r} ranks {ranks} generation {r.generation}"
