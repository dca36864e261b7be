"""Every RPC of the coordinator fed arbitrary and mutated requests over a real server.

Requests are drawn from the service's own protobuf descriptors (so a new RPC or field is
fuzzed without touching this file), with values biased to the edges: traversal paths,
NUL, overlong strings, 2**64-1, broken and hostile JSON. A second test sends byte-mutated
encodings of valid requests. Each call must end in time with OK or a clear refusal: a
status from ckptd's error map whose message says what was wrong, never INTERNAL,
UNKNOWN or a Python exception text. After the fuzzing the same server still commits a
normal save.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from coordinator_fixtures import TOKEN, ServerThread, finished
from google.protobuf import descriptor as _d
from google.protobuf.message import Message
from hypothesis import given
from hypothesis import strategies as st

import ckpt
from ckptd.coordinator.planning import ChunkPlan
from ckptd.coordinator.types import SaveRef, ShardReport
from ckptd.errors import CkptError
from ckptd.server import ServerOptions
from ckptd.v1 import coordinator_pb2 as pb

pytestmark = pytest.mark.timeout(180)

SERVICE = pb.DESCRIPTOR.services_by_name["Coordinator"]
METHODS = [m.name for m in SERVICE.methods]
MD = (("authorization", f"Bearer {TOKEN}"),)
# BeginSave waits at the barrier for the other ranks, AwaitCommit (and MemorySave's
# "await" phase) for the commit: for
# them (only) running into the client's deadline is the expected outcome of a plan that
# is valid but incomplete. Every other RPC answers at once.
BLOCKING = {
    "BeginSave": 1.5,
    "BeginSaveNode": 1.5,
    "AwaitCommit": 1.5,
    "MemorySave": 1.5,
    "NodeSession": 1.5,  # carries BeginSaveNode and AwaitCommit
}
DEADLINE_S = 10.0
# What a refusal may look like: ckptd's error map (ckptd/server/errors.py), and gRPC's own
# RESOURCE_EXHAUSTED for oversize. INTERNAL and UNKNOWN mean an unexpected exception.
REFUSALS = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}
PYTHON_LEAKS = ("Traceback", "zip()", "NoneType", "object has no attribute", "internal error")

STRINGS = st.one_of(
    st.sampled_from(
        [
            "",
            "job",
            "team/job",
            "../escape",
            "job/../../escape",
            "/etc",
            "/",
            ".",
            "job\x00nul",
            "a" * 5000,
            "shards/rank-00000.bin",
            "shards/../../x.bin",
            "float32",
            "bfloat16",
            "object",
            "full",
            "size",
            "0" * 64,
            "ränk",
            "job/step-000000000001",
        ]
    ),
    st.text(max_size=30),
)
UINTS = st.one_of(
    st.sampled_from([0, 1, 2, 3, 4096, 2**31, 2**32 - 1, 2**62, 2**63, 2**64 - 1]),
    st.integers(0, 2**64 - 1),
)
_JSON = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), STRINGS),
    lambda c: st.one_of(st.lists(c, max_size=3), st.dictionaries(STRINGS, c, max_size=3)),
    max_leaves=8,
)
BYTES = st.one_of(
    st.sampled_from(
        [
            b"",
            b"{}",
            b"[]",
            b"null",
            b"{",
            b"NaN",
            b'{"x": NaN}',
            b"[" * 50_000 + b"]" * 50_000,
            b"1" * 5000,
            b"\xff\xfe",
            b'{"tensor": "nope"}',
            b'{"dict": [["a", 1, 2]]}',
        ]
    ),
    _JSON.map(lambda v: json.dumps(v).encode()),
    st.binary(max_size=40),
)


def _uint_max(field: _d.FieldDescriptor) -> int:
    return (1 << 32) - 1 if field.type in (field.TYPE_UINT32, field.TYPE_FIXED32) else 2**64 - 1


def _value(field: _d.FieldDescriptor) -> st.SearchStrategy[Any]:
    t = field.type
    if t == field.TYPE_MESSAGE:
        return message(field.message_type)
    if t == field.TYPE_STRING:
        return STRINGS
    if t == field.TYPE_BYTES:
        return BYTES
    if t == field.TYPE_BOOL:
        return st.booleans()
    if t in (field.TYPE_DOUBLE, field.TYPE_FLOAT):
        return st.floats(allow_nan=True, width=64 if t == field.TYPE_DOUBLE else 32)
    if t == field.TYPE_ENUM:
        return st.sampled_from([v.number for v in field.enum_type.values])
    hi = _uint_max(field)
    return UINTS.map(lambda v: v & hi)


def message(desc: _d.Descriptor) -> st.SearchStrategy[Message]:
    """Any message of type `desc`: each field absent or drawn from its edge-biased values."""
    cls = getattr(pb, desc.name)

    @st.composite
    def build(draw: st.DrawFn) -> Message:
        msg = cls()
        oneof_set: set[str] = set()
        for f in desc.fields:
            if f.containing_oneof is not None:
                if f.containing_oneof.name in oneof_set or draw(st.booleans()):
                    continue
                oneof_set.add(f.containing_oneof.name)
            elif not draw(st.integers(0, 3)):  # absent a quarter of the time
                continue
            if f.is_repeated:
                vals = draw(st.lists(_value(f), max_size=3))
                getattr(msg, f.name).extend(vals)
            elif f.type == f.TYPE_MESSAGE:
                getattr(msg, f.name).CopyFrom(draw(_value(f)))
            else:
                setattr(msg, f.name, draw(_value(f)))
        return msg

    return build()


def _request_class(method: str) -> type[Message]:
    return getattr(pb, SERVICE.methods_by_name[method].input_type.name)


def _response_class(method: str) -> type[Message]:
    return getattr(pb, SERVICE.methods_by_name[method].output_type.name)


def call(channel: grpc.Channel, method: str, data: bytes) -> tuple[grpc.StatusCode, str]:
    """One call with raw request bytes; (code, details), OK included. On the node session
    (a stream) the bytes are one NodeCall, and an error answer counts as the call's status."""
    if SERVICE.methods_by_name[method].client_streaming:
        return call_stream(channel, method, data)
    rpc = channel.unary_unary(
        f"/{SERVICE.full_name}/{method}",
        request_serializer=None,
        response_deserializer=_response_class(method).FromString,
    )
    try:
        rpc(data, timeout=BLOCKING.get(method, DEADLINE_S), metadata=MD)
    except grpc.RpcError as e:
        return e.code(), e.details() or ""
    return grpc.StatusCode.OK, ""


def call_stream(channel: grpc.Channel, method: str, data: bytes) -> tuple[grpc.StatusCode, str]:
    rpc = channel.stream_stream(
        f"/{SERVICE.full_name}/{method}",
        request_serializer=None,
        response_deserializer=_response_class(method).FromString,
    )
    try:
        for answer in rpc(iter([data]), timeout=BLOCKING.get(method, DEADLINE_S), metadata=MD):
            if answer.WhichOneof("answer") == "error":
                codes = {c.value[0]: c for c in grpc.StatusCode}
                return codes.get(answer.error.code, grpc.StatusCode.UNKNOWN), answer.error.details
    except grpc.RpcError as e:
        return e.code(), e.details() or ""
    return grpc.StatusCode.OK, ""


def check_answer(method: str, code: grpc.StatusCode, details: str) -> None:
    if code == grpc.StatusCode.OK:
        return
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        assert method in BLOCKING, f"{method} hung past {DEADLINE_S}s"
        return
    assert code in REFUSALS, f"{method}: {code.name}: {details}"
    assert len(details) >= 10, f"{method}: {code.name} with no explanation: {details!r}"
    assert not any(leak in details for leak in PYTHON_LEAKS), f"{method}: {details}"


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    root = tmp_path_factory.mktemp("rpc-fuzz") / "root"
    s = ServerThread(root, options=ServerOptions(token=TOKEN), lease_s=2.0, barrier_timeout_s=1.0)
    try:
        yield s
    finally:
        s.stop(grace=0.2)


@pytest.fixture(scope="module")
def channel(fuzz_server: ServerThread) -> Any:
    opts = [("grpc.max_send_message_length", 16 << 20), ("grpc.enable_retries", 0)]
    with grpc.insecure_channel(fuzz_server.address, options=opts) as ch:
        yield ch


_saves = itertools.count(1)


def assert_still_saves(server: ServerThread) -> None:
    """A well-behaved client commits and loads a save on the fuzzed server."""
    n = next(_saves)
    job = str(Path(server.root) / f"sane-{n}")
    w = torch.arange(64, dtype=torch.float32) * n
    with ckpt.Checkpointer(job, coordinator=server.address, token=TOKEN, attempt="a") as cp:
        assert finished(cp.save({"w": w}, 1)).step == 1
        got = {"w": torch.zeros(64)}
        cp.load(got)
    assert torch.equal(got["w"], w)


@pytest.mark.parametrize("method", METHODS)
def test_fuzz_rpc_requests(fuzz_server, channel, tally, method):
    @given(req=message(SERVICE.methods_by_name[method].input_type))
    def one(req: Message) -> None:
        with tally.bad_input(f"rpc-fuzz:{method}"):
            code, details = call(channel, method, req.SerializeToString())
            check_answer(method, code, details)

    one()
    assert_still_saves(fuzz_server)


def _mutate(data: bytes, edits: list[tuple[int, int, int]]) -> bytes:
    b = bytearray(data)
    for op, pos, val in edits:
        if not b:
            b.append(val)
            continue
        pos %= len(b)
        if op == 0:
            b[pos] = val
        elif op == 1:
            del b[pos]
        elif op == 2:
            b.insert(pos, val)
        else:
            del b[pos:]
    return bytes(b)


def _valid(method: str, job: str) -> Message:
    ref = pb.SaveRef(job=job, step=7, generation=0, rank=0, world_size=1)
    chunk = pb.Chunk(
        key="w",
        dtype="float32",
        shape=[4],
        chunk_offsets=[0],
        chunk_sizes=[4],
        length=16,
        digest=bytes(32),
    )
    begin = pb.BeginSaveRequest(
        ref=ref, chunks=[chunk], parts=1, state=b'{"tensor":"w"}', timeout_ms=500
    )
    report = pb.ReportShardRequest(
        ref=ref,
        shard_path="shards/rank-00000.bin",
        size=4096,
        index_path="shards/rank-00000.json",
        index_size=100,
        index_blake3="0" * 64,
        verify="full",
    )
    return {
        "OpenJob": lambda: pb.OpenJobRequest(job=job, attempt="a"),
        "BeginSave": lambda: begin,
        "BeginSaveNode": lambda: pb.NodeBeginSaveRequest(node="node0", ranks=[begin]),
        "KeepAliveNode": lambda: pb.NodeKeepAliveRequest(
            node="node0", ranks=[pb.KeepAliveRequest(ref=ref)]
        ),
        "ReportShardsNode": lambda: pb.NodeReportRequest(node="node0", ranks=[report]),
        "NodeSession": lambda: pb.NodeCall(
            id=1, report_shards=pb.NodeReportRequest(node="node0", ranks=[report])
        ),
        "KeepAlive": lambda: pb.KeepAliveRequest(ref=ref),
        "ReportShard": lambda: report,
        "AwaitCommit": lambda: pb.AwaitCommitRequest(ref=ref, timeout_ms=100),
        "AbortSave": lambda: pb.AbortSaveRequest(ref=ref, reason="x"),
        "ListCheckpoints": lambda: pb.ListCheckpointsRequest(job=job),
        "GetCheckpoint": lambda: pb.GetCheckpointRequest(job=job, step=1),
        "Quarantine": lambda: pb.QuarantineRequest(job=job, step=1, reason="x"),
        "RecordTier": lambda: pb.RecordTierRequest(
            job=job, step=1, tier="mirror", url="s3://bucket/job", status="HELD"
        ),
        "MemorySave": lambda: pb.MemorySaveRequest(
            ref=ref,
            phase="held",
            report=json.dumps(
                {
                    "shard": {
                        "rank": 0,
                        "path": "shards/rank-00000.bin",
                        "size": 4096,
                        "index": "shards/rank-00000.json",
                        "index_size": 100,
                        "index_blake3": "0" * 64,
                    },
                    "held": [{"node": 0, "index_blake3": "0" * 64}],
                    "node": 0,
                    "nodes": 1,
                    "copies": 1,
                    "block_size": 1 << 20,
                    "alignment": 4096,
                    "state": {"tensor": "w"},
                }
            ).encode(),
        ),
    }[method]()


def test_every_method_has_a_valid_seed() -> None:
    for m in METHODS:
        assert isinstance(_valid(m, "job"), _request_class(m))


@pytest.mark.parametrize("method", METHODS)
def test_fuzz_mutated_encodings(fuzz_server, channel, tally, method):
    """Byte edits of a valid request's encoding: garbage protobuf is refused, not crashed on."""
    seed = _valid(method, f"mut-{method}").SerializeToString()

    @given(
        edits=st.lists(
            st.tuples(st.integers(0, 3), st.integers(0, 1 << 16), st.integers(0, 255)),
            min_size=1,
            max_size=6,
        )
    )
    def one(edits: list[tuple[int, int, int]]) -> None:
        with tally.bad_input(f"rpc-fuzz:{method}"):
            code, details = call(channel, method, _mutate(seed, edits))
            if code == grpc.StatusCode.INTERNAL and "deserializ" in details.lower():
                return  # gRPC's own refusal of bytes that are not the request message
            check_answer(method, code, details)

    one()
    assert_still_saves(fuzz_server)


# ----------------------------------------------------------------------------- the core


INTS = st.one_of(st.sampled_from([-1, 0, 1, 2, 2**62, 2**64, -(2**63)]), st.integers())
CORE_REFS = st.builds(SaveRef, STRINGS, INTS, INTS, INTS, INTS)
CORE_CHUNKS = st.lists(
    st.builds(
        ChunkPlan,
        STRINGS,
        STRINGS,
        st.lists(INTS, max_size=3).map(tuple),
        st.lists(INTS, max_size=3).map(tuple),
        st.lists(INTS, max_size=3).map(tuple),
        INTS,
        STRINGS,
    ),
    max_size=3,
)


@given(
    method=st.sampled_from(["begin", "keep_alive", "report", "await", "abort", "get", "open"]),
    ref=CORE_REFS,
    chunks=CORE_CHUNKS,
    text=STRINGS,
)
def test_fuzz_core_directly(fuzz_server, tally, method, ref, chunks, text):
    """The transport-free core with values the wire cannot carry (negative, past 2**64):
    embedded callers and future transports get the same clear refusals."""
    core = fuzz_server.core
    calls = {
        "begin": lambda: core.begin_save(ref, chunks, state=None, timeout_s=0.5),
        "keep_alive": lambda: core.keep_alive(ref),
        "report": lambda: core.report_shard(ref, ShardReport(text, ref.step, text, 1, text)),
        "await": lambda: core.await_commit(ref, 0.2),
        "abort": lambda: core.abort_save(ref, text),
        "open": lambda: core.open_job(ref.job, text),
    }

    async def one() -> Any:
        if method == "get":
            return core.get_checkpoint(ref.job, ref.step)
        return await asyncio.wait_for(calls[method](), 3)

    with tally.bad_input(f"core-fuzz:{method}"):
        try:
            fuzz_server.call(one(), timeout=10)
        except CkptError as e:
            assert len(str(e)) >= 10 and not any(x in str(e) for x in PYTHON_LEAKS), str(e)
        except TimeoutError:
            assert method == "begin" and ref.world_size > 1, "the core hung"
