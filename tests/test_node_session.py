"""The node session (ckptd.server.node_session): a node aggregator's calls on one stream.

Real parts: the real core and grpc.aio server on port 0 (with its interceptors: token,
call guard), the real NodeAggregator, whose ranks are CoordinatorClients pointed at it.
The session must answer exactly what the unary node calls answer, check the token when it
opens, refuse what does not parse and a runaway number of calls, and hand every call it
cannot carry (an older coordinator, a restart) to the unary path, then come back.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import grpc
import pytest
from coordinator_fixtures import ServerThread, free_port, make_certs, new_core, wait_for

from ckptd.errors import InvalidRequest, SaveAborted
from ckptd.server import node_session
from ckptd.server.app import ServerOptions
from ckptd.server.auth import TokenAuthInterceptor
from ckptd.server.client import CoordinatorClient
from ckptd.server.node import NodeAggregator
from ckptd.server.servicer import CoordinatorServicer
from ckptd.v1 import coordinator_pb2 as pb
from ckptd.v1 import coordinator_pb2_grpc as pb_grpc

TOKEN = "s3cret-node-session"


def begin_req(job: str, rank: int, world: int, step: int = 1, dtype: str = "uint8"):
    ref = pb.SaveRef(job=job, step=step, generation=0, rank=rank, world_size=world)
    chunk = pb.Chunk(
        key=f"k{rank}", dtype=dtype, shape=[4], chunk_offsets=[0], chunk_sizes=[4], length=4
    )
    chunk.digest = bytes(32)
    return pb.BeginSaveRequest(ref=ref, chunks=[chunk], part=0, parts=1, timeout_ms=20_000)


@pytest.fixture
def coordinator(tmp_path: Path):
    s = ServerThread(tmp_path / "root", options=ServerOptions(token=TOKEN), lease_s=30)
    client = CoordinatorClient(s.address, token=TOKEN)
    _, job = client.open_job("job", "attempt-1")
    yield s, client, job
    client.close()
    s.stop()


def aggregator(
    client: CoordinatorClient, ranks: list[int]
) -> tuple[NodeAggregator, CoordinatorClient]:
    agg = NodeAggregator(client, "host-a/node0", ranks, token=TOKEN)
    return agg, CoordinatorClient(agg.address, token=TOKEN, connect_retry_s=5)


async def open_raw(address: str, token: str | None, *, raw: bool = False):
    """A NodeSession stream opened by hand (raw: bytes in, bytes out, no protobuf)."""
    channel = grpc.aio.insecure_channel(address)
    metadata = (("authorization", f"Bearer {token}"),) if token else ()
    if raw:
        call = channel.stream_stream(
            "/ckptd.v1.Coordinator/NodeSession",
            request_serializer=lambda b: b,
            response_deserializer=lambda b: b,
        )(metadata=metadata)
    else:
        call = channel.stream_stream(
            "/ckptd.v1.Coordinator/NodeSession",
            request_serializer=pb.NodeCall.SerializeToString,
            response_deserializer=pb.NodeAnswer.FromString,
        )(metadata=metadata)
    return channel, call


def test_a_node_batch_goes_by_the_session_and_answers_as_unary(coordinator) -> None:
    s, client, job = coordinator
    agg, rank = aggregator(client, [0])
    try:
        got = rank.begin_save_pb(begin_req(job, 0, 1))
        assert got.complete and list(got.write) == [0], got
        assert (agg.session.calls_sent, agg.session.fell_back) == (1, 0)
        # The client learnt its lease from the session's answer, as from the unary call.
        assert client.lease_s == 30
    finally:
        rank.close()
        agg.close()


def test_an_error_answer_is_the_unary_calls_error(coordinator, tally) -> None:
    """The same class and the same message (the save named once) as the unary call's."""
    s, client, job = coordinator
    with pytest.raises(InvalidRequest) as unary:
        client.begin_save_node("host-a/node0", [begin_req(job, 1, 2, dtype="no-such-dtype")])
    agg, rank = aggregator(client, [1])
    try:
        with tally.bad_input("node session: bad dtype"), pytest.raises(InvalidRequest) as err:
            rank.begin_save_pb(begin_req(job, 1, 2, step=2, dtype="no-such-dtype"))
        assert agg.session.calls_sent == 1 and agg.session.fell_back == 0
        msg = str(err.value)
        assert "node 'host-a/node0'" in msg and "dtype 'no-such-dtype'" in msg, msg
        assert msg.count(f"job {job!r}") == 1 and msg.count(" step 2") == 1, msg
        # After the call's name, the unary call's own message, word for word.
        tail = str(unary.value).split("generation 0: ", 1)[1]
        assert msg.rsplit("generation 0: ", 1)[1] == tail, (unary.value, msg)
    finally:
        rank.close()
        agg.close()


@pytest.mark.parametrize("token", [None, "wrong"])
def test_the_token_is_checked_when_the_session_opens(coordinator, tally, token) -> None:
    s, client, job = coordinator

    async def go() -> grpc.aio.AioRpcError:
        channel, call = await open_raw(s.address, token)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await call.read()
        await channel.close()
        return e.value

    with tally.bad_input(f"node session: {'no' if token is None else 'wrong'} token"):
        e = asyncio.run(go())
    assert e.code() == grpc.StatusCode.UNAUTHENTICATED
    assert ("missing token" if token is None else "wrong token") in e.details(), e.details()


def test_a_message_that_does_not_parse_ends_the_session_clearly(coordinator, tally) -> None:
    s, client, job = coordinator

    async def go() -> grpc.aio.AioRpcError:
        channel, call = await open_raw(s.address, TOKEN, raw=True)
        await call.write(b"\xff\xff\xff\xff not a NodeCall")
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await call.read()
        await channel.close()
        return e.value

    with tally.bad_input("node session: undecodable message"):
        e = asyncio.run(go())
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "NodeSession: the request is not a valid protobuf message" in e.details()


def test_a_call_without_a_body_is_answered_with_an_error(coordinator, tally) -> None:
    s, client, job = coordinator

    async def go() -> pb.NodeAnswer:
        channel, call = await open_raw(s.address, TOKEN)
        await call.write(pb.NodeCall(id=7))
        got = await call.read()
        await call.done_writing()
        await channel.close()
        return got

    with tally.bad_input("node session: empty call"):
        got = asyncio.run(go())
    assert got.id == 7 and got.WhichOneof("answer") == "error"
    assert got.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "no call in the message" in got.error.details


def test_too_many_calls_in_flight_on_one_session_are_refused(
    coordinator, tally, monkeypatch
) -> None:
    """A runaway aggregator: calls beyond the session's limit are answered
    RESOURCE_EXHAUSTED at once, the ones in flight are not disturbed."""
    s, client, job = coordinator
    monkeypatch.setattr(node_session, "MAX_IN_FLIGHT", 3)

    def join() -> None:
        with pytest.raises(SaveAborted):  # aborted when the test is over
            client.begin_save_pb(begin_req(job, 0, 2))

    joined = threading.Thread(target=join, daemon=True)
    joined.start()  # rank 0 waits at the barrier: the save is open
    wait_for(lambda: s.core.sessions, 10, "the save to open")
    ref = begin_req(job, 0, 2).ref

    async def go() -> list[pb.NodeAnswer]:
        channel, call = await open_raw(s.address, TOKEN)
        for i in range(1, 5):
            wait = pb.AwaitCommitRequest(ref=ref, timeout_ms=3_000)
            await call.write(pb.NodeCall(id=i, await_commit=wait))
        answers = [await call.read() for _ in range(4)]
        await call.done_writing()
        await channel.close()
        return answers

    with tally.bad_input("node session: too many calls in flight"):
        answers = asyncio.run(go())
    first = answers[0]
    assert first.id == 4 and first.error.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
    assert "calls in flight, the limit is 3" in first.error.details
    # The three in flight are answered when their wait ends: the save still open.
    assert sorted(a.id for a in answers[1:]) == [1, 2, 3]
    assert all(a.status.status == pb.OPEN for a in answers[1:]), answers
    client.abort_save_pb(pb.AbortSaveRequest(ref=ref, reason="test over"))
    joined.join(10)


def test_an_older_coordinator_is_served_by_unary(tmp_path: Path) -> None:
    """A coordinator without NodeSession answers UNIMPLEMENTED: the aggregator sends the
    node calls by unary (from then on, or until a later, rarer try), and the save goes on."""

    class Older(CoordinatorServicer):  # what a coordinator of before the session serves
        async def NodeSession(self, request_iterator, context):  # type: ignore[override]
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    core = new_core(str(tmp_path / "root"), lease_s=30, barrier_timeout_s=20)

    async def start() -> tuple[grpc.aio.Server, int]:
        await core.start()
        server = grpc.aio.server(interceptors=[TokenAuthInterceptor(TOKEN)])
        pb_grpc.add_CoordinatorServicer_to_server(Older(core), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, port

    server, port = asyncio.run_coroutine_threadsafe(start(), loop).result(30)
    client = CoordinatorClient(f"127.0.0.1:{port}", token=TOKEN)
    _, job = client.open_job("job", "a")
    agg, rank = aggregator(client, [0])
    try:
        assert rank.begin_save_pb(begin_req(job, 0, 1)).complete
        assert agg.session.fell_back == 1
        tried = agg.session.calls_sent
        assert rank.begin_save_pb(begin_req(job, 0, 1, step=2)).complete
        assert agg.session.fell_back == 2 and agg.session.calls_sent == tried  # not again
    finally:
        rank.close()
        agg.close()
        client.close()
        asyncio.run_coroutine_threadsafe(server.stop(0), loop).result(10)
        asyncio.run_coroutine_threadsafe(core.close(), loop).result(10)
        core.catalog.close()
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()  # a loop left open warns when collected, in whichever test runs then


def test_a_coordinator_restart_moves_calls_to_unary_and_the_session_comes_back(
    tmp_path: Path, tally
) -> None:
    root = tmp_path / "root"
    port = free_port()
    s = ServerThread(root, options=ServerOptions(token=TOKEN), port=port, lease_s=30)
    client = CoordinatorClient(s.address, token=TOKEN, retry_for_s=30)
    _, job = client.open_job("job", "a")
    agg, rank = aggregator(client, [0])
    agg.session.reopen_after_s = 0.2
    try:
        assert rank.begin_save_pb(begin_req(job, 0, 1)).complete
        assert agg.session.calls_sent == 1
        with tally.fault("node session: coordinator restart"):
            s.stop()
            s = ServerThread(root, options=ServerOptions(token=TOKEN), port=port, lease_s=30)
            # The stream broke with the old server; this call goes by unary (which retries
            # across the restart) or on a stream reopened to the new one.
            wait_for(lambda: agg.session._call is None, 10, "the session to notice")
            got = rank.begin_save_pb(begin_req(job, 0, 1, step=2))
            assert got.complete
        assert agg.session.fell_back + agg.session.calls_sent >= 2
        time.sleep(0.3)
        sent = agg.session.calls_sent
        assert rank.begin_save_pb(begin_req(job, 0, 1, step=3)).complete
        assert agg.session.calls_sent == sent + 1, "the session did not come back"
    finally:
        rank.close()
        agg.close()
        client.close()
        s.stop()


def test_the_session_runs_over_tls_with_the_clients_credentials(tmp_path: Path) -> None:
    """The aggregator opens its session with the client's own TLS credentials and token."""
    certs = make_certs(tmp_path / "certs")
    if certs is None:
        pytest.skip("openssl is not installed")
    opts = ServerOptions(token=TOKEN, tls_cert=certs["server.pem"], tls_key=certs["server.key"])
    s = ServerThread(tmp_path / "root", options=opts, lease_s=30, host="localhost")
    client = CoordinatorClient(s.address, token=TOKEN, root_certificates=certs["ca.pem"])
    _, job = client.open_job("job", "a")
    agg, rank = aggregator(client, [0])
    try:
        assert rank.begin_save_pb(begin_req(job, 0, 1)).complete
        assert (agg.session.calls_sent, agg.session.fell_back) == (1, 0)
    finally:
        rank.close()
        agg.close()
        client.close()
        s.stop()
