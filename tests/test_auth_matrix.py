"""Who may talk to the coordinator: every refusal, with its status and what to do.

Real grpc.aio servers on port 0, real certificates (two independent CAs made with the
openssl CLI), real clients. Refused: no token, a wrong token, the token of another
coordinator (another root), a plain-text client against TLS, a server certificate from a
CA the client does not trust, mutual TLS without a client certificate or with one from
another CA, and a client with too many calls in flight. A well-behaved client keeps
saving while a runaway one is refused.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from coordinator_fixtures import TOKEN, ServerThread, finished, make_certs

import ckpt
from ckptd.errors import CoordinatorUnavailable, Unauthenticated, UnsafePath
from ckptd.server import ServerOptions
from ckptd.server.client import CoordinatorClient
from ckptd.v1 import coordinator_pb2 as pb
from ckptd.v1 import coordinator_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(120)

SERVICE = pb.DESCRIPTOR.services_by_name["Coordinator"]
OTHER_TOKEN = "token-of-root-b-91c2"


@pytest.fixture(autouse=True)
def _no_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in ("RANK", "WORLD_SIZE", "CKPTD_ADDRESS", "CKPTD_TOKEN", "CKPT_ATTEMPT"):
        monkeypatch.delenv(k, raising=False)


@pytest.fixture
def two_roots(tmp_path: Path) -> Any:
    a = ServerThread(tmp_path / "a", options=ServerOptions(token=TOKEN))
    b = ServerThread(tmp_path / "b", options=ServerOptions(token=OTHER_TOKEN))
    try:
        yield a, b
    finally:
        a.stop(0.2)
        b.stop(0.2)


def _bare_call(
    address: str, method: str, token: str | None, *, raw_header: bool = False
) -> grpc.RpcError:
    """`method` with an empty request and the given token (raw_header: as the header's
    whole value, without "Bearer "); the RpcError it must raise. A streaming method (the
    node session) gets its one request as a stream and must be refused when it opens."""
    req = getattr(pb, SERVICE.methods_by_name[method].input_type.name)()
    value = token if raw_header else f"Bearer {token}"
    md = (("authorization", value),) if token is not None else ()
    streaming = SERVICE.methods_by_name[method].client_streaming
    with grpc.insecure_channel(address) as ch:
        stub = getattr(pb_grpc.CoordinatorStub(ch), method)
        with pytest.raises(grpc.RpcError) as ei:
            if streaming:
                list(stub(iter([req]), timeout=10, metadata=md))
            else:
                stub(req, timeout=10, metadata=md)
    return ei.value


@pytest.mark.parametrize("method", [m.name for m in SERVICE.methods])
def test_every_method_needs_the_token(two_roots, tally, method):
    a, b = two_roots
    cases = [
        ("auth:no-token", None, "missing token"),
        ("auth:wrong-token", TOKEN + "x", "wrong token"),
        ("auth:other-root", OTHER_TOKEN, "wrong token"),  # B's token against A
        ("auth:not-bearer", TOKEN, "wrong token"),  # the bare token, without "Bearer "
    ]
    for kind, token, why in cases:
        with tally.bad_input(kind):
            err = _bare_call(a.address, method, token, raw_header=kind == "auth:not-bearer")
            assert err.code() == grpc.StatusCode.UNAUTHENTICATED, (kind, err)
            assert why in err.details() and "CKPTD_TOKEN" in err.details(), err.details()


def test_token_of_another_root(two_roots, tally):
    """Each coordinator accepts only its own token, and only jobs under its own root."""
    a, b = two_roots
    job_a, job_b = str(Path(a.root) / "job"), str(Path(b.root) / "job")
    with tally.bad_input("auth:other-root"):
        c = CoordinatorClient(a.address, token=OTHER_TOKEN, retry_for_s=0.5)
        try:
            with pytest.raises(Unauthenticated, match="wrong token.*CKPTD_TOKEN"):
                c.open_job(job_a, "x")
            with pytest.raises(Unauthenticated):
                c.list_checkpoints(job_b)
        finally:
            c.close()
        with pytest.raises(Unauthenticated):
            ckpt.Checkpointer(job_a, coordinator=a.address, token=OTHER_TOKEN, attempt="x")
    with tally.bad_input("path-traversal"):
        # A's token is good at A, but B's root is not A's to write into.
        c = CoordinatorClient(a.address, token=TOKEN, retry_for_s=0.5)
        try:
            with pytest.raises(UnsafePath, match="outside the coordinator's root"):
                c.open_job(job_b, "x")
        finally:
            c.close()
    assert not (Path(b.root) / "job").exists()
    # Each with its own token saves.
    for srv, tok, job in ((a, TOKEN, job_a), (b, OTHER_TOKEN, job_b)):
        with ckpt.Checkpointer(job, coordinator=srv.address, token=tok, attempt="a") as cp:
            assert finished(cp.save({"w": torch.ones(4)}, 1)).step == 1


# ----------------------------------------------------------------------------- TLS


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, bytes]]:
    """Two independent CAs, each with a server and a client certificate."""
    out = {}
    for name in ("ours", "theirs"):
        c = make_certs(tmp_path_factory.mktemp(f"pki-{name}"))
        if c is None:
            pytest.skip("no openssl CLI to make test certificates")
        out[name] = c
    return out


def _refused_handshake(address: str, **kw: Any) -> str:
    c = CoordinatorClient(address, token=TOKEN, retry_for_s=0.3, call_timeout_s=0.5, **kw)
    try:
        with pytest.raises(CoordinatorUnavailable) as ei:
            c.open_job("job", "a")
    finally:
        c.close()
    msg = str(ei.value)
    assert "UNAVAILABLE" in msg and "TLS" in msg, msg  # says what to check
    return msg


def test_tls_refusals(pki, tmp_path, tally):
    ours, theirs = pki["ours"], pki["theirs"]
    s = ServerThread(
        tmp_path / "root",
        options=ServerOptions(token=TOKEN, tls_cert=ours["server.pem"], tls_key=ours["server.key"]),
    )
    try:
        with tally.bad_input("tls:plaintext-client"):
            _refused_handshake(s.address)
        with tally.bad_input("tls:server-from-other-ca"):
            _refused_handshake(s.address, root_certificates=theirs["ca.pem"])
        with tally.bad_input("auth:no-token"):
            c = CoordinatorClient(s.address, root_certificates=ours["ca.pem"], retry_for_s=0.3)
            try:
                with pytest.raises(Unauthenticated):
                    c.open_job("job", "a")
            finally:
                c.close()
        ok = CoordinatorClient(s.address, token=TOKEN, root_certificates=ours["ca.pem"])
        try:
            assert ok.open_job("job", "a") == (0, "job")
        finally:
            ok.close()
    finally:
        s.stop(0.2)


def test_mutual_tls_refusals(pki, tmp_path, tally):
    ours, theirs = pki["ours"], pki["theirs"]
    s = ServerThread(
        tmp_path / "root",
        options=ServerOptions(
            token=TOKEN,
            tls_cert=ours["server.pem"],
            tls_key=ours["server.key"],
            tls_client_ca=ours["ca.pem"],
        ),
    )
    try:
        cases = {
            "tls:no-client-cert": None,
            "tls:other-ca": (theirs["client.key"], theirs["client.pem"]),
            "tls:self-signed-client": (ours["rogue.key"], ours["rogue.pem"]),
        }
        for kind, cert in cases.items():
            with tally.bad_input(kind):
                _refused_handshake(s.address, root_certificates=ours["ca.pem"], client_cert=cert)
        with tally.bad_input("tls:plaintext-client"):
            _refused_handshake(s.address)
        good = CoordinatorClient(
            s.address,
            token=TOKEN,
            root_certificates=ours["ca.pem"],
            client_cert=(ours["client.key"], ours["client.pem"]),
        )
        try:
            assert good.open_job("job", "a") == (0, "job")
        finally:
            good.close()
    finally:
        s.stop(0.2)


# ----------------------------------------------------------------------------- limits


class SteadySaver:
    """A well-behaved client saving step after step in a thread, until stopped."""

    def __init__(self, server: ServerThread, job: str):
        self.server, self.job = server, job
        self.steps: list[int] = []
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            with ckpt.Checkpointer(
                self.job, coordinator=self.server.address, token=TOKEN, attempt="steady"
            ) as cp:
                step = 0
                while not self._stop.is_set():
                    step += 1
                    finished(cp.save({"w": torch.full((256,), float(step))}, step))
                    self.steps.append(step)
        except BaseException as e:  # noqa: BLE001 - checked by the test
            self.error = e

    def progressed(self, since: int, timeout: float = 20) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.error is None:
            if len(self.steps) > since:
                return True
            time.sleep(0.02)
        return False

    def stop(self) -> list[int]:
        self._stop.set()
        self._thread.join(60)
        if self.error is not None:
            raise self.error
        return self.steps


def test_too_many_calls_from_one_client(tmp_path, tally):
    """A client over its share of calls in flight is refused at once; others save meanwhile."""
    limit = 4
    s = ServerThread(
        tmp_path / "root", options=ServerOptions(token=TOKEN, max_calls_per_client=limit)
    )
    steady = SteadySaver(s, str(tmp_path / "root" / "steady"))
    md = (("authorization", f"Bearer {TOKEN}"),)
    # Rank 0 of a 2-rank save waits at the barrier: each such call stays in flight.
    waiting = pb.BeginSaveRequest(
        ref=pb.SaveRef(job="runaway", step=1, generation=0, rank=0, world_size=2),
        parts=1,
        state=b"1",
        timeout_ms=30_000,
    )
    # Its own connection: channels of one process with equal options share one (gRPC's
    # global subchannel pool), and so count as one client.
    own = [("grpc.use_local_subchannel_pool", 1)]
    try:
        with grpc.insecure_channel(s.address, options=own) as ch:
            stub = pb_grpc.CoordinatorStub(ch)
            held = [stub.BeginSave.future(waiting, timeout=60, metadata=md) for _ in range(limit)]
            time.sleep(0.5)
            assert not any(f.done() for f in held), [f.exception() for f in held if f.done()]
            n = len(steady.steps)
            for _ in range(3):
                with tally.bad_input("too-many-calls"):
                    with pytest.raises(grpc.RpcError) as ei:
                        stub.ListCheckpoints(pb.ListCheckpointsRequest(job="x"), 5, md)
                    assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                    assert f"limit per client connection is {limit}" in ei.value.details()
                    assert "wait for answers" in ei.value.details()
            # Meanwhile the well-behaved client keeps saving.
            assert steady.progressed(n), steady.error
            # Releasing the runaway's calls gives it its share back.
            abort = pb.AbortSaveRequest(
                ref=pb.SaveRef(job="runaway", step=1, generation=0, rank=1, world_size=2),
                reason="test over",
            )
            with grpc.insecure_channel(s.address, options=own) as other:
                pb_grpc.CoordinatorStub(other).AbortSave(abort, timeout=10, metadata=md)
            for f in held:
                with pytest.raises(grpc.RpcError) as ei:
                    f.result(timeout=30)
                assert ei.value.code() == grpc.StatusCode.ABORTED
            stub.ListCheckpoints(pb.ListCheckpointsRequest(job="x"), timeout=5, metadata=md)
    finally:
        steps = steady.stop()
        s.stop(0.2)
    assert steps, "the well-behaved client saved nothing"


def test_undecodable_request_is_invalid_argument(tmp_path, tally):
    s = ServerThread(tmp_path / "root", options=ServerOptions(token=TOKEN))
    try:
        with grpc.insecure_channel(s.address) as ch:
            rpc = ch.unary_unary(
                f"/{SERVICE.full_name}/OpenJob",
                request_serializer=None,
                response_deserializer=pb.OpenJobResponse.FromString,
            )
            with tally.bad_input("rpc-garbage-bytes"):
                with pytest.raises(grpc.RpcError) as ei:
                    rpc(
                        b"\xff\xff\xff",
                        timeout=10,
                        metadata=(("authorization", f"Bearer {TOKEN}"),),
                    )
                assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "same ckptd version" in ei.value.details()
    finally:
        s.stop(0.2)


def test_serve_has_the_per_client_limit() -> None:
    from ckptd.cli import serve

    args = serve.build_parser().parse_args(["serve", "--root", "r", "--max-calls-per-client", "7"])
    assert args.max_calls_per_client == 7
    default = serve.build_parser().parse_args(["serve", "--root", "r"])
    assert default.max_calls_per_client == ServerOptions().max_calls_per_client
