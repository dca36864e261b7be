"""The coordinator over gRPC: a real grpc.aio server on port 0 and real clients.

Auth (token; health and reflection open), TLS and mutual TLS (certificates made with the
openssl CLI), message limits, error codes, catalog queries, graceful stop, and `ckptd
serve` as a process.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from ckpt_testutil import DelegatingStorage, DelegatingWriteHandle, tensor_raw
from coordinator_fixtures import (
    TOKEN,
    RankSim,
    Serve,
    ServerThread,
    ckptctl,
    finished,
    free_port,
    make_certs,
    read_catalog,
    wait_for,
)
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

import ckpt
from ckptd.coordinator.planning import ChunkPlan
from ckptd.coordinator.types import SaveRef
from ckptd.errors import (
    CheckpointNotFound,
    CoordinatorUnavailable,
    DivergentReplicas,
    InvalidRequest,
    SaveAborted,
    ShardMissing,
    StaleGeneration,
    Unauthenticated,
    UnsafePath,
)
from ckptd.format import layout
from ckptd.server import ServerOptions
from ckptd.server.app import SERVICE_NAME
from ckptd.server.client import CoordinatorClient
from ckptd.storage.base import Storage, WriteHandle
from ckptd.v1 import coordinator_pb2 as pb
from ckptd.v1 import coordinator_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(90)


@pytest.fixture(autouse=True)
def _one_process_world(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in (
        "RANK",
        "WORLD_SIZE",
        "CKPTD_ADDRESS",
        "CKPTD_TOKEN",
        "CKPT_ATTEMPT",
        "TORCHELASTIC_RUN_ID",
        "CKPT_CRASH_AT",
    ):
        monkeypatch.delenv(k, raising=False)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "root"


@pytest.fixture
def server(root: Path):
    s = ServerThread(root, options=ServerOptions(token=TOKEN))
    try:
        yield s
    finally:
        s.stop()


def client(server: ServerThread, token: str | None = TOKEN, **kw) -> CoordinatorClient:
    kw.setdefault("retry_for_s", 1.0)
    kw.setdefault("call_timeout_s", 10.0)
    return CoordinatorClient(server.address, token=token, **kw)


def plan(key: str, data: bytes) -> ChunkPlan:
    from ckptd.format import hashing

    return ChunkPlan(
        key,
        "uint8",
        (len(data),),
        (0,),
        (len(data),),
        len(data),
        hashing.chunk_digest([hashing.digest(data)]),
    )


def test_a_coordinator_that_comes_up_late_is_reached_within_the_retry_window(
    root: Path,
) -> None:
    """A rank that starts while its coordinator is still starting (or restarting) retries
    UNAVAILABLE for connect_retry_s. Its channel tries to reconnect at least every second,
    so a coordinator that is up 9 s later is reached inside a 13 s window; with gRPC's own
    spacing (1 s, growing 1.6x) the channel's attempts fell near 9.3 s and then 15.9 s, so a
    rank often gave up on a coordinator that was already serving (the kill soak saw it)."""
    port = free_port()
    c = CoordinatorClient(f"127.0.0.1:{port}", token=TOKEN, connect_retry_s=13)
    got: dict[str, Any] = {}

    def open_job() -> None:
        try:
            got["generation"] = c.open_job("job", "a")[0]
        except Exception as e:  # noqa: BLE001 - handed to the test's thread
            got["error"] = e

    t = threading.Thread(target=open_job)
    t.start()
    time.sleep(9)
    assert t.is_alive(), got  # still retrying: nothing answers yet
    s = ServerThread(root, options=ServerOptions(token=TOKEN), port=port)
    try:
        t.join(10)
        assert not t.is_alive() and "generation" in got, got
    finally:
        c.close()
        s.stop()


# ----------------------------------------------------------------------------- auth


def test_token_auth(server: ServerThread, root: Path) -> None:
    job = str(root / "job")
    for token, why in ((None, "missing token"), ("wrong", "wrong token")):
        c = client(server, token)
        try:
            with pytest.raises(Unauthenticated, match=why):
                c.open_job(job, "a")
            with pytest.raises(Unauthenticated):
                c.list_checkpoints(job)
        finally:
            c.close()
    # The status code itself, with a bare stub.
    with grpc.insecure_channel(server.address) as ch:
        stub = pb_grpc.CoordinatorStub(ch)
        with pytest.raises(grpc.RpcError) as ei:
            stub.OpenJob(pb.OpenJobRequest(job=job, attempt="a"), timeout=10)
        assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as ei:
            stub.OpenJob(
                pb.OpenJobRequest(job=job, attempt="a"),
                timeout=10,
                metadata=(("authorization", f"Bearer {TOKEN}x"),),
            )
        assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED
        r = stub.OpenJob(
            pb.OpenJobRequest(job=job, attempt="a"),
            timeout=10,
            metadata=(("authorization", f"Bearer {TOKEN}"),),
        )
        assert (r.generation, r.job) == (0, "job")
        # Health needs no token.
        health = health_pb2_grpc.HealthStub(ch)
        for service in ("", SERVICE_NAME):
            h = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert h.status == health_pb2.HealthCheckResponse.SERVING
        # Reflection lists the service.
        refl = reflection_pb2_grpc.ServerReflectionStub(ch)
        answers = list(
            refl.ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10
            )
        )
        names = {s.name for a in answers for s in a.list_services_response.service}
        assert "ckptd.v1.Coordinator" in names and "grpc.health.v1.Health" in names
        files = list(
            refl.ServerReflectionInfo(
                iter(
                    [
                        reflection_pb2.ServerReflectionRequest(
                            file_containing_symbol="ckptd.v1.Coordinator"
                        )
                    ]
                ),
                timeout=10,
            )
        )
        assert files[0].file_descriptor_response.file_descriptor_proto


# ----------------------------------------------------------------------------- a save over gRPC


def test_checkpointer_over_grpc_and_catalog_queries(server: ServerThread, root: Path) -> None:
    job = str(root / "team" / "job")
    w = torch.randn(32, 16, generator=torch.Generator().manual_seed(1))
    with ckpt.Checkpointer(job, coordinator=server.address, token=TOKEN, attempt="a1") as cp:
        assert cp.generation == 0 and cp.job_name == "team/job"
        for step in (10, 20):
            r = finished(cp.save({"w": w * step, "step": step}, step, metadata={"step": step}))
            assert r.step == step and r.bytes > 0
        got = {"w": torch.zeros(32, 16), "step": 0}
        res = cp.load(got)
        assert res.step == 20 and res.metadata == {"step": 20}
        assert tensor_raw(got["w"]) == tensor_raw(w * 20) and got["step"] == 20
    c = client(server)
    try:
        infos = c.list_checkpoints(job)
        assert [(i.step, i.status, i.generation, i.world_size) for i in infos] == [
            (10, "COMMITTED", 0, 1),
            (20, "COMMITTED", 0, 1),
        ]
        latest = c.get_checkpoint(job)
        assert latest.step == 20 and latest.bytes > 0 and len(latest.manifest_blake3) == 64
        from ckptd.format import hashing

        assert latest.manifest_blake3 == hashing.digest(
            (Path(job) / "step-000000000020" / "MANIFEST.json").read_bytes()
        )
        assert c.get_checkpoint(job, 10).step == 10
        assert c.get_checkpoint("team/job", 10).step == 10  # relative to the root
        with pytest.raises(CheckpointNotFound):
            c.get_checkpoint(job, 15)
        with pytest.raises(CheckpointNotFound):
            c.get_checkpoint(str(root / "empty"))
        with pytest.raises(UnsafePath):
            c.list_checkpoints("/etc")
    finally:
        c.close()
    # ckptctl sees the same through the coordinator and from storage alone.
    rc, out, err = ckptctl("list", job, "--coordinator", server.address, "--token", TOKEN, "--json")
    assert rc == 0, err
    assert [(s["step"], s["status"]) for s in json.loads(out)["steps"]] == [
        (10, "COMMITTED"),
        (20, "COMMITTED"),
    ]
    rc, out, err = ckptctl("verify", job, "--all")
    assert rc == 0, out + err


def test_job_outside_root_is_permission_denied(server: ServerThread, tmp_path: Path) -> None:
    with pytest.raises(UnsafePath, match="outside"):
        ckpt.Checkpointer(
            tmp_path / "elsewhere", coordinator=server.address, token=TOKEN, attempt="a"
        )
    with grpc.insecure_channel(server.address) as ch:
        with pytest.raises(grpc.RpcError) as ei:
            pb_grpc.CoordinatorStub(ch).OpenJob(
                pb.OpenJobRequest(job="../x", attempt="a"),
                timeout=10,
                metadata=(("authorization", f"Bearer {TOKEN}"),),
            )
        assert ei.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert not (tmp_path / "elsewhere").exists()


def test_error_codes_stale_and_divergent(server: ServerThread, root: Path) -> None:
    job = str(root / "job")
    c0, c1 = client(server), client(server)
    try:
        assert c0.open_job(job, "a")[0] == 0
        assert c0.open_job(job, "b")[0] == 1
        with pytest.raises(StaleGeneration, match="older"):
            c0.begin_save(
                SaveRef(job, 1, 0, 0, 1),
                [plan("x", b"a")],
                state=None,
                metadata=None,
                allow_divergent=False,
                keep_last=0,
                timeout_s=5,
            )
        out: dict[int, BaseException] = {}

        def rank(r: int, c: CoordinatorClient) -> None:
            try:
                c.begin_save(
                    SaveRef(job, 2, 1, r, 2),
                    [plan("x", bytes([r]) * 8)],
                    state=1,
                    metadata=None,
                    allow_divergent=False,
                    keep_last=0,
                    timeout_s=10,
                )
            except BaseException as e:  # noqa: BLE001 - recorded for the assertion
                out[r] = e

        ts = [threading.Thread(target=rank, args=(r, c)) for r, c in ((0, c0), (1, c1))]
        for t in ts:
            t.start()
        for t in ts:
            t.join(30)
        for r in (0, 1):
            assert isinstance(out.get(r), DivergentReplicas), out
            assert "'x'" in str(out[r]) and f"rank {r}/2" in str(out[r])
        # A save that does not exist.
        with pytest.raises(InvalidRequest):
            c0.await_commit(SaveRef(job, 99, 1, 0, 1), 1)
        # A rank that fails before BeginSave aborts the save for the others at once.
        st = c0.abort_save(SaveRef(job, 98, 1, 1, 2), "staging failed")
        assert st.status == "ABORTED" and "staging failed" in st.reason
        with pytest.raises(SaveAborted, match="staging failed"):
            c1.begin_save(
                SaveRef(job, 98, 1, 0, 2),
                [plan("x", b"a")],
                state=1,
                metadata=None,
                allow_divergent=False,
                keep_last=0,
                timeout_s=5,
            )
        # Rank out of range.
        with pytest.raises(InvalidRequest):
            c0.keep_alive(SaveRef(job, 2, 1, 5, 2))
    finally:
        c0.close()
        c1.close()
    assert read_catalog(root / ".ckptd" / "catalog.sqlite")[2]["status"] == "ABORTED"


# ----------------------------------------------------------------------------- limits


def test_oversized_message_is_refused_while_others_work(
    server: ServerThread, root: Path, tally
) -> None:
    job = str(root / "job")
    stop = threading.Event()
    normal: list[object] = []

    def steady() -> None:
        c = client(server)
        try:
            while not stop.is_set():
                normal.append(c.open_job(job, "steady"))
                time.sleep(0.01)
        except BaseException as e:  # noqa: BLE001
            normal.append(e)
        finally:
            c.close()

    t = threading.Thread(target=steady)
    t.start()
    try:
        opts = [
            ("grpc.max_send_message_length", 64 << 20),
            ("grpc.max_receive_message_length", 64 << 20),
        ]
        with grpc.insecure_channel(server.address, options=opts) as ch:
            stub = pb_grpc.CoordinatorStub(ch)
            md = (("authorization", f"Bearer {TOKEN}"),)
            big = pb.BeginSaveRequest(
                ref=pb.SaveRef(job=job, step=1, generation=0, rank=0, world_size=1),
                state=b"[" + b"1," * (9 << 19) + b"1]",  # 9 MiB
            )
            assert big.ByteSize() > 8 << 20
            for _ in range(2):
                with tally.bad_input("oversized-message"):
                    with pytest.raises(grpc.RpcError) as ei:
                        stub.BeginSave(big, timeout=30, metadata=md)
                    assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            # Just under the transport limit, but over the JSON limit: parsed, refused.
            mid = pb.BeginSaveRequest(
                ref=pb.SaveRef(job=job, step=1, generation=0, rank=0, world_size=1),
                state=b"1" * (5 << 20),
            )
            with tally.bad_input("oversized-json-field"):
                with pytest.raises(grpc.RpcError) as ei:
                    stub.BeginSave(mid, timeout=30, metadata=md)
                assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "state is" in ei.value.details()
            n_before = len(normal)
            time.sleep(0.2)
            assert len(normal) > n_before
    finally:
        stop.set()
        t.join(30)
    assert normal and all(x == (0, "job") for x in normal), normal[-3:]
    # The server is still healthy after refusing.
    c = client(server)
    try:
        assert c.open_job(job, "after")[0] == 1
    finally:
        c.close()


# ----------------------------------------------------------------------------- TLS


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    c = make_certs(tmp_path_factory.mktemp("certs"))
    if c is None:
        pytest.skip("no openssl CLI and no cryptography package to make test certificates")
    return c


def test_tls(certs: dict[str, bytes], root: Path) -> None:
    s = ServerThread(
        root,
        options=ServerOptions(
            token=TOKEN, tls_cert=certs["server.pem"], tls_key=certs["server.key"]
        ),
    )
    try:
        job = str(root / "job")
        ok = CoordinatorClient(s.address, token=TOKEN, root_certificates=certs["ca.pem"])
        try:
            assert ok.open_job(job, "a") == (0, "job")
        finally:
            ok.close()
        with ckpt.Checkpointer(
            job, coordinator=s.address, token=TOKEN, attempt="a", tls_root_cert=certs["ca.pem"]
        ) as cp:
            finished(cp.save({"w": torch.ones(3)}, 1))
        plain = CoordinatorClient(s.address, token=TOKEN, retry_for_s=0.2, call_timeout_s=1)
        try:
            with pytest.raises(CoordinatorUnavailable):
                plain.open_job(job, "a")
        finally:
            plain.close()
        untrusted = CoordinatorClient(
            s.address,
            token=TOKEN,
            root_certificates=certs["rogue.pem"],
            retry_for_s=0.2,
            call_timeout_s=1,
        )
        try:
            with pytest.raises(CoordinatorUnavailable):
                untrusted.open_job(job, "a")
        finally:
            untrusted.close()
        # TLS does not replace the token.
        notoken = CoordinatorClient(s.address, root_certificates=certs["ca.pem"])
        try:
            with pytest.raises(Unauthenticated):
                notoken.open_job(job, "a")
        finally:
            notoken.close()
    finally:
        s.stop()


def test_mutual_tls(certs: dict[str, bytes], root: Path) -> None:
    s = ServerThread(
        root,
        options=ServerOptions(
            token=TOKEN,
            tls_cert=certs["server.pem"],
            tls_key=certs["server.key"],
            tls_client_ca=certs["ca.pem"],
        ),
    )
    try:
        job = str(root / "job")
        good = CoordinatorClient(
            s.address,
            token=TOKEN,
            root_certificates=certs["ca.pem"],
            client_cert=(certs["client.key"], certs["client.pem"]),
        )
        try:
            assert good.open_job(job, "a") == (0, "job")
        finally:
            good.close()
        for cert in (None, (certs["rogue.key"], certs["rogue.pem"])):
            bad = CoordinatorClient(
                s.address,
                token=TOKEN,
                root_certificates=certs["ca.pem"],
                client_cert=cert,
                retry_for_s=0.2,
                call_timeout_s=1,
            )
            try:
                with pytest.raises(CoordinatorUnavailable):
                    bad.open_job(job, "a")
            finally:
                bad.close()
    finally:
        s.stop()


def test_ckptctl_commands_reach_a_tls_coordinator(
    certs: dict[str, bytes], root: Path, tmp_path: Path
) -> None:
    """list --coordinator and verify --coordinator take the same token and TLS options
    (list used to build a plain channel and could not reach a TLS coordinator at all)."""
    pem = tmp_path / "pem"
    pem.mkdir()
    for name, data in certs.items():
        (pem / name).write_bytes(data)
    s = ServerThread(
        root,
        options=ServerOptions(
            token=TOKEN,
            tls_cert=certs["server.pem"],
            tls_key=certs["server.key"],
            tls_client_ca=certs["ca.pem"],
        ),
    )
    try:
        job = str(root / "job")
        with ckpt.Checkpointer(
            job,
            coordinator=s.address,
            token=TOKEN,
            attempt="a",
            tls_root_cert=certs["ca.pem"],
            tls_client_cert=(certs["client.key"], certs["client.pem"]),
        ) as cp:
            finished(cp.save({"w": torch.ones(3)}, 1))
        tls = [
            "--coordinator",
            s.address,
            "--token",
            TOKEN,
            "--tls-root-cert",
            str(pem / "ca.pem"),
            "--tls-client-cert",
            str(pem / "client.pem"),
            "--tls-client-key",
            str(pem / "client.key"),
        ]
        rc, out, err = ckptctl("list", job, *tls, "--json")
        assert rc == 0, err
        doc = json.loads(out)
        assert doc["coordinator"] == s.address
        assert [(x["step"], x["status"]) for x in doc["steps"]] == [(1, "COMMITTED")]
        rc, out, err = ckptctl("verify", job, *tls, "--json")
        assert rc == 0, err
        assert json.loads(out)["steps"][0]["problems"] == []
        # A key without its certificate is a usage error, on every coordinator command.
        for command in ("list", "verify"):
            rc, _, err = ckptctl(command, job, *tls[:-2], "--json")
            assert rc == 2 and "--tls-client-key" in err, (command, err)
    finally:
        s.stop()


# ----------------------------------------------------------------------------- stopping


def test_graceful_stop(root: Path) -> None:
    s = ServerThread(root, options=ServerOptions(token=TOKEN))
    job = str(root / "job")
    outcome: list[object] = []
    md = (("authorization", f"Bearer {TOKEN}"),)
    ch = grpc.insecure_channel(s.address)
    stub = pb_grpc.CoordinatorStub(ch)

    def waiting_rank() -> None:  # rank 0 of 2 waits at the barrier; rank 1 never comes
        from ckptd.server import converters as cv

        req = pb.BeginSaveRequest(
            ref=pb.SaveRef(job=job, step=1, generation=0, rank=0, world_size=2),
            chunks=[cv.chunk_to_pb(plan("x", b"abc"))],
            parts=1,
            state=b"1",
        )
        try:
            outcome.append(stub.BeginSave(req, timeout=60, metadata=md))
        except grpc.RpcError as e:
            outcome.append(e.code())

    try:
        with ckpt.Checkpointer(job, coordinator=s.address, token=TOKEN, attempt="a") as cp:
            finished(cp.save({"w": torch.ones(3)}, 0))
        t = threading.Thread(target=waiting_rank)
        t.start()
        time.sleep(0.3)
        t0 = time.monotonic()
        s.stop(grace=0.5)
        t.join(30)
        assert time.monotonic() - t0 < 10
        assert outcome in (
            [grpc.StatusCode.UNAVAILABLE],
            [grpc.StatusCode.CANCELLED],
            [grpc.StatusCode.ABORTED],
        ), outcome
        c = client(s, retry_for_s=0.2, call_timeout_s=1)
        try:
            with pytest.raises(CoordinatorUnavailable):
                c.list_checkpoints(job)
        finally:
            c.close()
    finally:
        ch.close()
        s.stop()
    # What was committed before the stop is there for the next life.
    s2 = ServerThread(root, options=ServerOptions(token=TOKEN))
    try:
        c2 = client(s2)
        try:
            infos = {i.step: i.status for i in c2.list_checkpoints(job)}
        finally:
            c2.close()
    finally:
        s2.stop()
    assert infos[0] == "COMMITTED" and infos.get(1) in ("ABORTED", None), infos


@pytest.mark.timeout(120)
def test_ckptd_serve_process(tmp_path: Path) -> None:
    """The console script: refuses to run without a token; serves; SIGTERM stops it cleanly;
    a second life on the same root knows what the first committed."""
    from ckptd.cli import serve as serve_cli

    root = tmp_path / "root"
    assert serve_cli.main(["serve", "--root", str(root), "--listen", "127.0.0.1:0"]) == 2
    serve = Serve(root, tmp_path / "serve")
    job = str(root / "job")
    serve.start()
    try:
        with ckpt.Checkpointer(job, coordinator=serve.address, token=TOKEN, attempt="a") as cp:
            finished(cp.save({"w": torch.arange(12.0)}, 3))
        assert serve.stop() == 0
        assert "stopping" in serve.log()
        serve.start()
        rc, out, err = ckptctl(
            "list", job, "--coordinator", serve.address, "--token", TOKEN, "--json"
        )
        assert rc == 0, out + err
        assert [(s["step"], s["status"]) for s in json.loads(out)["steps"]] == [(3, "COMMITTED")]
    finally:
        serve.stop()
    assert os.path.exists(root / ".ckptd" / "catalog.sqlite")


def test_rank_failing_before_begin_aborts_the_others(
    server: ServerThread, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two ranks' Checkpointers (one process, real server): rank 1's state cannot be saved,
    so it aborts the save; rank 0's save fails at once, not after the barrier timeout."""
    job = str(root / "job")
    cps = []
    for r in range(2):
        monkeypatch.setenv("RANK", str(r))
        monkeypatch.setenv("WORLD_SIZE", "2")
        cps.append(
            ckpt.Checkpointer(
                job, coordinator=server.address, token=TOKEN, attempt="a", timeout_s=60
            )
        )
    try:
        with pytest.raises(ckpt.UnsupportedValue):
            cps[1].save({"w": torch.ones(2), "bad": object()}, 1)
        t0 = time.monotonic()
        with pytest.raises(SaveAborted, match="rank 1 aborted"):
            finished(cps[0].save({"w": torch.ones(2), "bad": 1}, 1))
        assert time.monotonic() - t0 < 20
        # The next step works for both.
        out: list[object] = [None, None]

        def save(r: int) -> None:
            out[r] = finished(cps[r].save({"w": torch.ones(2), "r": ckpt.PerRank(r)}, 2))

        ts = [threading.Thread(target=save, args=(r,)) for r in range(2)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(60)
        assert all(getattr(o, "step", None) == 2 for o in out), out
    finally:
        for cp in cps:
            cp.close()
    assert read_catalog(root / ".ckptd" / "catalog.sqlite")[1]["status"] == "ABORTED"


class WriteOutlivedByAbort(DelegatingStorage):
    """Shard writes under `step` finish only once the coordinator removed the file: a rank
    still writing when the save is aborted under it (the abort removes the save's files)."""

    def __init__(self, inner: Storage, step: int):
        super().__init__(inner)
        self.prefix = layout.step_dir(step) + "/"
        self.removed = threading.Event()

    def open_write(self, path: str, size: int, **kw: Any) -> WriteHandle:
        handle = super().open_write(path, size, **kw)
        if not path.startswith(self.prefix):
            return handle
        owner = self

        class Slow(DelegatingWriteHandle):
            def finish(self) -> None:
                wait_for(lambda: not owner.inner.exists(path), 30, f"the abort to remove {path}")
                owner.removed.set()
                super().finish()

        return Slow(handle)


def test_a_write_cut_by_the_coordinators_abort_raises_save_aborted_with_its_reason(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 1 joins step 2 and goes silent; its lease expires while rank 0 is still writing,
    so the coordinator aborts the save and removes its files under rank 0. Rank 0 is told
    why (SaveAborted naming rank 1's lease), not the ShardMissing its verify ran into; step
    1 still loads and step 3 commits."""
    # Long enough that a live rank's keep-alive (every lease/3) never misses it on a busy CI.
    server = ServerThread(root, options=ServerOptions(token=TOKEN), lease_s=2.0)
    job = str(root / "job")
    cps: list[ckpt.Checkpointer] = []

    def state(r: int, step: int) -> dict[str, Any]:
        return {
            "w": torch.arange(64.0) * step,
            "mine": ckpt.PerRank(torch.full((1024,), float(r * 100 + step))),
        }

    def save_both(step: int) -> list[Any]:
        out: list[Any] = [None, None]

        def save(r: int) -> None:
            try:
                out[r] = finished(cps[r].save(state(r, step), step))
            except BaseException as e:  # noqa: BLE001 - recorded for the assertion
                out[r] = e

        ts = [threading.Thread(target=save, args=(r,)) for r in range(2)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(60)
        return out

    try:
        for r in range(2):
            monkeypatch.setenv("RANK", str(r))
            monkeypatch.setenv("WORLD_SIZE", "2")
            cps.append(ckpt.Checkpointer(job, coordinator=server.address, token=TOKEN, attempt="a"))
        assert [getattr(o, "step", o) for o in save_both(1)] == [1, 1]

        # Rank 1 joins step 2 (the plan is made) and then sends nothing: a dead process.
        sim = RankSim(server.core, job, 1, 2, cps[1].generation)
        sim.prepare(state(1, 2))
        joined = threading.Thread(
            target=cps[1].client.begin_save,
            args=(sim.ref(2), sim.plan),
            kwargs={
                "state": sim.node,
                "metadata": None,
                "allow_divergent": False,
                "keep_last": 0,
                "timeout_s": 30,
            },
        )
        joined.start()
        plain = cps[0].storage
        slow = cps[0].storage = WriteOutlivedByAbort(plain, 2)
        pending = cps[0].save(state(0, 2), 2)
        with pytest.raises(SaveAborted) as err:
            pending.wait()
        joined.join(30)
        assert slow.removed.is_set()
        msg = str(err.value)
        assert "step 2 rank 0/2" in msg and "rank(s) 1 silent" in msg and "lease" in msg, msg
        assert isinstance(err.value.__cause__, ShardMissing), repr(err.value.__cause__)
        assert not (Path(job) / layout.step_dir(2) / layout.MANIFEST_NAME).exists()

        # The previous checkpoint is intact and the next save proceeds.
        target = state(0, 0)
        assert cps[0].load(target).step == 1
        assert torch.equal(target["w"], state(0, 1)["w"])
        assert torch.equal(target["mine"].value, state(0, 1)["mine"].value)
        cps[0].storage = plain
        assert [getattr(o, "step", o) for o in save_both(3)] == [3, 3]
    finally:
        for cp in cps:
            cp.close()
        server.stop()
    steps = read_catalog(root / ".ckptd" / "catalog.sqlite")
    assert steps[2]["status"] == "ABORTED" and "rank(s) 1 silent" in steps[2]["reason"]
