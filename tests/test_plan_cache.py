"""Plans cached across steps, and chunk digests as raw bytes, over a real grpc.aio server.

A save whose layout (keys, dtypes, shapes, boxes, in order) equals the one the
coordinator accepted from the rank before sends only the layout's digest and the chunks'
digests; a coordinator that does not hold it (restarted) makes the client send the whole
plan once; a layout digest that is not the plan's, and digests of the wrong size, are
refused naming the save. What goes on the wire is recorded at the servicer, as parsed
from the bytes the client sent.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from ckpt_testutil import tensor_raw
from coordinator_fixtures import TOKEN, ServerThread, finished

import ckpt
from ckptd.coordinator import planning
from ckptd.coordinator.layouts import LayoutCache, layout_digest
from ckptd.coordinator.planning import ChunkPlan
from ckptd.errors import DivergentReplicas, LayoutUnknown
from ckptd.format import hashing
from ckptd.server import ServerOptions
from ckptd.server import converters as cv
from ckptd.server.servicer import CoordinatorServicer
from ckptd.v1 import coordinator_pb2 as pb
from ckptd.v1 import coordinator_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(120)
KEY = "model.decoder.layers.{}.self_attention.query_key_value.weight"


@pytest.fixture(autouse=True)
def _one_process_world(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in ("RANK", "WORLD_SIZE", "CKPTD_ADDRESS", "CKPTD_TOKEN", "CKPT_ATTEMPT"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)


@pytest.fixture
def wire(monkeypatch: pytest.MonkeyPatch) -> list[pb.BeginSaveRequest]:
    """Every BeginSave request a server made after this fixture receives, as parsed off
    the wire (patched before the server registers its servicer)."""
    seen: list[pb.BeginSaveRequest] = []
    original = CoordinatorServicer.BeginSave

    async def recording(self: Any, request: pb.BeginSaveRequest, context: Any) -> Any:
        copy = pb.BeginSaveRequest()
        copy.CopyFrom(request)
        seen.append(copy)
        return await original(self, request, context)

    monkeypatch.setattr(CoordinatorServicer, "BeginSave", recording)
    return seen


@pytest.fixture
def server(wire: list[pb.BeginSaveRequest], tmp_path: Path) -> Iterator[ServerThread]:
    s = ServerThread(tmp_path / "root", options=ServerOptions(token=TOKEN))
    try:
        yield s
    finally:
        s.stop()


def model(step: int, layers: int = 12, rows: int = 8) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {
        "model": {KEY.format(i): torch.randn(rows, 16, generator=g) for i in range(layers)},
        "step": step,
    }


def checkpointer(server: ServerThread, job: str) -> ckpt.Checkpointer:
    return ckpt.Checkpointer(job, coordinator=server.address, token=TOKEN, attempt="a1")


def of_step(wire: list[pb.BeginSaveRequest], step: int) -> list[pb.BeginSaveRequest]:
    return [r for r in wire if r.ref.step == step]


def is_cached(r: pb.BeginSaveRequest) -> bool:
    return not r.chunks and len(r.layout_digest) == 32 and len(r.digests) > 0


def test_a_second_save_of_the_same_layout_sends_the_digest_only(
    server: ServerThread, wire: list[pb.BeginSaveRequest], tmp_path: Path
) -> None:
    job = str(tmp_path / "root" / "job")
    states = {s: model(s) for s in (1, 2, 3)}
    with checkpointer(server, job) as cp:
        for step, state in states.items():
            finished(cp.save(state, step))
        (first,), (second,), (third,) = (of_step(wire, s) for s in (1, 2, 3))
        n = len(first.chunks)
        assert n == 12 and not is_cached(first) and first.layout_digest
        for r in (second, third):
            assert is_cached(r), r
            assert r.layout_digest == first.layout_digest
            assert len(r.digests) == 32 * n  # the chunks' digests, raw
            plan_only = pb.BeginSaveRequest()
            plan_only.CopyFrom(r)
            plan_only.ClearField("state")  # the state tree (it names its tensors) goes each save
            wire_bytes = plan_only.SerializeToString()
            assert b"self_attention" not in wire_bytes and b"float32" not in wire_bytes
        # Keys, dtypes, shapes and boxes went once: the cached plan is a fraction of it.
        plan_bytes = sum(c.ByteSize() for c in first.chunks)
        assert second.ByteSize() - len(second.state) < first.ByteSize() - plan_bytes / 2
        assert all(len(c.digest) == 32 for c in first.chunks)
        got = model(0)
        res = cp.load(got, step=2)
        assert res.step == 2
        for k, t in states[2]["model"].items():
            assert tensor_raw(got["model"][k]) == tensor_raw(t), k
    # Storage keeps its format: the index lists every block's blake3 as hex.
    idx = next((Path(job) / "step-000000000003" / "shards").glob("*.json"))
    entries = json.loads(idx.read_text())["entries"]
    assert all(hashing.is_hex_digest(h) for e in entries for h in e["blake3"])


def test_a_restarted_coordinator_gets_the_whole_plan_once(
    wire: list[pb.BeginSaveRequest], tmp_path: Path
) -> None:
    root = tmp_path / "root"
    job = str(root / "job")
    first = ServerThread(root, options=ServerOptions(token=TOKEN))
    port = first.port
    try:
        cp = checkpointer(first, job)
        finished(cp.save(model(1), 1))
        finished(cp.save(model(2), 2))
        assert [is_cached(r) for r in wire] == [False, True]
    finally:
        first.stop()
    # The new coordinator holds no layouts: the cached plan is answered LayoutUnknown,
    # and the client sends the whole plan, once, then cached plans again.
    second = ServerThread(root, options=ServerOptions(token=TOKEN), port=port)
    try:
        finished(cp.save(model(3), 3))
        assert [is_cached(r) for r in of_step(wire, 3)] == [True, False]
        finished(cp.save(model(4), 4))
        assert [is_cached(r) for r in of_step(wire, 4)] == [True]
        got = model(0)
        assert cp.load(got, step=3).step == 3
        for k, t in model(3)["model"].items():
            assert tensor_raw(got["model"][k]) == tensor_raw(t), k
        cp.close()
    finally:
        second.stop()


def test_a_changed_layout_sends_the_whole_plan(
    server: ServerThread, wire: list[pb.BeginSaveRequest], tmp_path: Path
) -> None:
    job = str(tmp_path / "root" / "job")
    new_key = model(3)
    new_key["model"]["extra.bias"] = torch.ones(4)
    states = [
        model(1),
        model(2),
        new_key,  # a new key
        model(4, rows=6),  # resharded: other shapes under the same keys
        model(5, rows=6),  # unchanged again
    ]
    with checkpointer(server, job) as cp:
        for step, state in enumerate(states, 1):
            finished(cp.save(state, step))
    assert [is_cached(r) for r in wire] == [False, True, False, False, True]
    assert len({r.layout_digest for r in wire}) == 3


def _refused(
    stub: pb_grpc.CoordinatorStub, req: pb.BeginSaveRequest, code: grpc.StatusCode, match: str
) -> str:
    with pytest.raises(grpc.RpcError) as ei:
        stub.BeginSave(req, timeout=20, metadata=(("authorization", f"Bearer {TOKEN}"),))
    assert ei.value.code() == code, ei.value.details()
    details = ei.value.details() or ""
    assert match in details, details
    return details


def _plan(n: int = 3) -> list[ChunkPlan]:
    return [
        ChunkPlan(f"w{i}", "uint8", (8,), (0,), (8,), 8, hashing.digest(bytes([i]) * 8))
        for i in range(n)
    ]


def _request(job: str, step: int, plan: list[ChunkPlan], **kw: Any) -> pb.BeginSaveRequest:
    kw.setdefault("chunks", [cv.chunk_to_pb(c) for c in plan])
    return pb.BeginSaveRequest(
        ref=pb.SaveRef(job=job, step=step, generation=0, rank=0, world_size=1),
        parts=1,
        state=b'{"dict":[]}',
        timeout_ms=5000,
        **kw,
    )


def test_a_layout_digest_that_is_not_the_plans_is_refused(
    server: ServerThread, tally: Any, tmp_path: Path
) -> None:
    job = str(tmp_path / "root" / "job")
    plan = _plan()
    with grpc.insecure_channel(server.address) as ch:
        stub = pb_grpc.CoordinatorStub(ch)
        other = layout_digest(_plan(2))
        with tally.bad_input("plan-cache:layout digest not the plan's"):
            details = _refused(
                stub,
                _request(job, 1, plan, layout_digest=other),
                grpc.StatusCode.INVALID_ARGUMENT,
                "the rank claimed",
            )
            assert "step 1 rank 0" in details and other.hex()[:16] in details
        with tally.bad_input("plan-cache:cached plan, digests for another layout"):
            good = layout_digest(plan)
            stub.BeginSave(
                _request(job, 2, plan, layout_digest=good),
                timeout=20,
                metadata=(("authorization", f"Bearer {TOKEN}"),),
            )  # step 2 accepted: the coordinator holds the layout now
            # The layout is known now; a cached plan with digests for 2 chunks, not 3.
            details = _refused(
                stub,
                _request(job, 3, plan, chunks=[], layout_digest=good, digests=bytes(64)),
                grpc.StatusCode.INVALID_ARGUMENT,
                "must be 3 x 32 bytes",
            )
            assert "step 3 rank 0" in details
        with tally.bad_input("plan-cache:unknown layout"):
            # A digest this coordinator never accepted: LayoutUnknown, the save stays open.
            req = _request(job, 4, plan, chunks=[], layout_digest=bytes(32), digests=bytes(96))
            with pytest.raises(grpc.RpcError) as ei:
                stub.BeginSave(req, timeout=20, metadata=(("authorization", f"Bearer {TOKEN}"),))
            assert ei.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert dict(ei.value.trailing_metadata())["ckptd-error"] == "LayoutUnknown"
            stub.BeginSave(
                _request(job, 4, plan, layout_digest=good),
                timeout=20,
                metadata=(("authorization", f"Bearer {TOKEN}"),),
            )


def _known_layout(stub: pb_grpc.CoordinatorStub, job: str, plan: list[ChunkPlan]) -> bytes:
    """Have the coordinator accept `plan` (step 1) and so hold its layout."""
    good = layout_digest(plan)
    stub.BeginSave(
        _request(job, 1, plan, layout_digest=good),
        timeout=20,
        metadata=(("authorization", f"Bearer {TOKEN}"),),
    )
    return good


@pytest.mark.parametrize("size", [0, 31, 33, 64])
def test_malformed_chunk_digests_are_refused(
    server: ServerThread, tally: Any, tmp_path: Path, size: int
) -> None:
    job = str(tmp_path / "root" / "job")
    with grpc.insecure_channel(server.address) as ch:
        stub = pb_grpc.CoordinatorStub(ch)
        with tally.bad_input("plan-cache:chunk digest of the wrong size"):
            req = _request(job, 1, _plan())
            req.chunks[1].digest = bytes(size)
            details = _refused(
                stub, req, grpc.StatusCode.INVALID_ARGUMENT, f"must be 32 raw bytes, got {size}"
            )
            assert "step 1 rank 0 key 'w1'" in details


@pytest.mark.parametrize("size", [0, 1, 95, 97, 128])
def test_malformed_cached_digests_are_refused(
    server: ServerThread, tally: Any, tmp_path: Path, size: int
) -> None:
    job = str(tmp_path / "root" / "job")
    plan = _plan()
    with grpc.insecure_channel(server.address) as ch:
        stub = pb_grpc.CoordinatorStub(ch)
        good = _known_layout(stub, job, plan)
        with tally.bad_input("plan-cache:cached digests of the wrong size"):
            req = _request(job, 2, plan, chunks=[], layout_digest=good, digests=bytes(size))
            details = _refused(stub, req, grpc.StatusCode.INVALID_ARGUMENT, "must be 3 x 32 bytes")
            assert f"job 'job' step 2 rank 0: the cached plan's digests are {size} bytes" in details


def test_the_layout_cache_is_bounded() -> None:
    cache = LayoutCache(per_rank=2, max_chunks=10)
    plans = {i: _plan(i + 1) for i in range(4)}
    for p in plans.values():
        cache.remember("j", 0, layout_digest(p), [p])
    # Two layouts per rank: the oldest two are gone.
    assert cache.chunks == 3 + 4
    for i in (2, 3):
        assert (
            len(cache.plan("j", 0, layout_digest(plans[i]), 0, 1, bytes(32 * (i + 1)), "")) == i + 1
        )
    with pytest.raises(LayoutUnknown, match="send the whole plan"):
        cache.plan("j", 0, layout_digest(plans[0]), 0, 1, bytes(32), "")
    # A chunk budget: another rank's layouts push out the least recently used rank.
    cache.remember("j", 1, layout_digest(plans[3]), [plans[3]])
    assert cache.chunks == 4
    with pytest.raises(LayoutUnknown):
        cache.plan("j", 0, layout_digest(plans[3]), 0, 1, bytes(128), "")


def _replicated(hashes: list[str], world: int = 4) -> dict[int, list[ChunkPlan]]:
    """A DDP-like plan: `w` replicated on every rank (rank r holds hashes[r]), `s` sharded."""
    return {
        r: [
            ChunkPlan("w", "uint8", (8,), (0,), (8,), 8, hashes[r]),
            ChunkPlan("s", "uint8", (8 * world,), (8 * r,), (8,), 8, hashing.digest(bytes([r]))),
        ]
        for r in range(world)
    }


def test_unchanged_layouts_reuse_the_assignment_but_still_compare_replicas(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    same = [hashing.digest(b"w")] * 4
    first = planning.assign(_replicated(same))
    assert first.replicas == [((0, 0), (1, 0), (2, 0), (3, 0))]
    tiled: list[str] = []
    original = planning._check_tiling
    monkeypatch.setattr(planning, "_check_tiling", lambda k, c: (tiled.append(k), original(k, c)))
    again = planning.assign(_replicated(same), reuse=first)
    assert (again.write, again.bytes_by_rank, tiled) == (first.write, first.bytes_by_rank, [])
    # A replica that differs is refused as without reuse, with the same words.
    odd = same[:2] + [hashing.digest(b"x")] + same[3:]
    with pytest.raises(DivergentReplicas) as fresh:
        planning.assign(_replicated(odd))
    with pytest.raises(DivergentReplicas) as reused:
        planning.assign(_replicated(odd), reuse=first)
    assert str(reused.value) == str(fresh.value) and "ranks [2] hold" in str(fresh.value)
    # Allowed: the lowest rank writes it, derived afresh (and not kept for reuse).
    allowed = planning.assign(_replicated(odd), allow_divergent=True, reuse=first)
    assert allowed.write == planning.assign(_replicated(odd), allow_divergent=True).write
    assert allowed.warnings and allowed.replicas is None


def test_the_coordinator_reuses_the_assignment_of_unchanged_layouts(
    server: ServerThread, wire: list[pb.BeginSaveRequest], tmp_path: Path, monkeypatch: Any
) -> None:
    tiled: list[int] = []
    original = planning._check_tiling

    def counting(key: str, chunks: list[ChunkPlan]) -> None:
        tiled.append(len(wire))
        original(key, chunks)

    monkeypatch.setattr(planning, "_check_tiling", counting)
    job = str(tmp_path / "root" / "job")
    with checkpointer(server, job) as cp:
        for step in (1, 2, 3):
            finished(cp.save(model(step), step))
        finished(cp.save(model(4, rows=6), 4))  # resharded: derived again
    # Tiling was checked for the first save's 12 keys and the resharded one's, not between.
    assert tiled == [1] * 12 + [4] * 12
