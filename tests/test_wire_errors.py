"""Errors over the wire: the class travels in the call's metadata, storage errors are final.

A real grpc.aio server on port 0 and the real client. A coordinator whose storage fails
(no space left for a quarantine marker) answers at once with a StorageError that names
the path, the errno and what to do; it is not retried as if the network were down. And
the client tells DivergentReplicas from StaleGeneration by the class the server sent,
whatever words the message holds.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
import torch
from ckpt_testutil import DelegatingStorage
from coordinator_fixtures import TOKEN, ServerThread, finished

import ckpt
from ckptd.coordinator.core import SaveRef
from ckptd.coordinator.planning import ChunkPlan
from ckptd.errors import (
    CoordinatorUnavailable,
    DivergentReplicas,
    SaveAborted,
    SaveFailed,
    StaleGeneration,
    StorageError,
)
from ckptd.format import checkpoint as ckfmt
from ckptd.format import hashing
from ckptd.server import ServerOptions
from ckptd.server.client import CoordinatorClient
from ckptd.server.errors import ERROR_KEY, error_from
from ckptd.storage import Storage, open_storage

pytestmark = pytest.mark.timeout(120)
RETRY_WINDOW_S = 20.0  # the client would retry a retryable status this long


@pytest.fixture(autouse=True)
def _one_process_world(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in ("RANK", "WORLD_SIZE", "CKPTD_ADDRESS", "CKPTD_TOKEN", "CKPT_ATTEMPT"):
        monkeypatch.delenv(k, raising=False)


class FailingMarkers(DelegatingStorage):
    """Writing a quarantine marker raises `fail(where)`; everything else is real."""

    def __init__(self, inner: Storage, fail: Callable[[str], BaseException]):
        super().__init__(inner)
        self.fail = fail
        self.attempts = 0

    def write_atomic(self, path: str, data: bytes) -> None:
        if not path.endswith(ckfmt.QUARANTINE_NAME):
            return self.inner.write_atomic(path, data)
        self.attempts += 1
        raise self.fail(f"{self.url}/{path}")


@dataclasses.dataclass
class Refused:
    error: BaseException
    took_s: float
    attempts: int
    server: ServerThread
    job: str


@contextlib.contextmanager
def quarantine_refused(
    tmp_path: Path, fail: Callable[[str], BaseException], expect: type[BaseException]
) -> Iterator[Refused]:
    """A real server whose storage fails the quarantine marker with `fail`: step 1 saved,
    then Quarantine called with the client's full retry window; the server still up."""
    root = tmp_path / "root"
    stores: list[FailingMarkers] = []

    def storage_factory(path: str) -> Storage:
        stores.append(FailingMarkers(open_storage(path, create=True), fail))
        return stores[-1]

    s = ServerThread(root, options=ServerOptions(token=TOKEN), storage_factory=storage_factory)
    try:
        job = str(root / "job")
        with ckpt.Checkpointer(job, coordinator=s.address, token=TOKEN, attempt="a") as cp:
            finished(cp.save({"w": torch.ones(4)}, 1))
        c = CoordinatorClient(s.address, token=TOKEN, retry_for_s=RETRY_WINDOW_S)
        try:
            t0 = time.monotonic()
            with pytest.raises(expect) as ei:
                c.quarantine(job, 1, "rank 0: block 0 of 'w' is corrupt")
            took = time.monotonic() - t0
        finally:
            c.close()
        yield Refused(ei.value, took, sum(x.attempts for x in stores), s, job)
    finally:
        s.stop()


def no_space(translated: bool) -> Callable[[str], BaseException]:
    """ENOSPC as storage raises it (StorageError with the errno), or as the kernel's
    OSError, with the path, that a storage let through untranslated."""

    def fail(where: str) -> BaseException:
        if translated:
            return StorageError(errno.ENOSPC, f"write {where} failed: {os.strerror(errno.ENOSPC)}")
        return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), where)

    return fail


@pytest.mark.parametrize("translated", [True, False], ids=["StorageError", "OSError"])
def test_a_full_disk_on_the_coordinator_is_a_storage_error_at_once(
    tmp_path: Path, translated: bool
) -> None:
    with quarantine_refused(tmp_path, no_space(translated), StorageError) as got:
        e, s, job = got.error, got.server, got.job
        assert isinstance(e, StorageError)
        marker = f"step-{1:012d}/{ckfmt.QUARANTINE_NAME}"
        # Answered, not retried: one attempt at the marker, well inside the retry window.
        assert got.attempts == 1
        assert got.took_s < 5.0, got.took_s
        assert not isinstance(e, CoordinatorUnavailable)
        msg = str(e)
        assert "unreachable" not in msg and "CKPTD_ADDRESS" not in msg, msg
        assert e.errno == errno.ENOSPC, msg
        assert f"job {job!r} step 1" in msg and marker in msg, msg
        assert "full" in msg and "ckptctl gc" in msg and s.address in msg, msg
        if not translated:
            assert e.filename is not None and e.filename.endswith(marker), e.filename
        # The catalog still holds the step as committed; nothing was half-done.
        assert s.core.catalog.save("job", 1).status == "COMMITTED"


@pytest.mark.parametrize(
    "words",
    [
        "cannot schedule new futures after shutdown",
        "cannot schedule new futures after interpreter shutdown",
    ],
    ids=["loop-closed", "interpreter-exiting"],
)
def test_a_stopping_coordinator_says_so_at_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, words: str
) -> None:
    """Work handed to a thread pool that takes no more (the coordinator's loop closed, or
    the interpreter exiting: the embedded coordinator of a rank that is exiting) is not an
    internal error with a traceback (a bug), and not retried as if the network were down
    (the rank's exit would wait out the retry window): SaveAborted, saying why."""
    with caplog.at_level("INFO", logger="ckptd"):
        with quarantine_refused(tmp_path, lambda _: RuntimeError(words), SaveAborted) as got:
            msg = str(got.error)
            assert got.attempts == 1 and got.took_s < 5.0, (got.took_s, msg)
            assert "Quarantine" in msg and "coordinator is stopping" in msg, msg
            assert "next start" in msg and "internal error" not in msg, msg
    assert not any(r.exc_info for r in caplog.records), [r.getMessage() for r in caplog.records]


def plan(key: str, data: bytes, dtype: str = "uint8") -> ChunkPlan:
    return ChunkPlan(
        key,
        dtype,
        (len(data),),
        (0,),
        (len(data),),
        len(data),
        hashing.chunk_digest([hashing.digest(data)]),
    )


def test_stale_and_divergent_are_told_apart_by_metadata_not_words(tmp_path: Path) -> None:
    root = tmp_path / "root"
    s = ServerThread(root, options=ServerOptions(token=TOKEN))
    # The job's name holds the word the client used to look for to spot divergence.
    job = str(root / "replica-job")
    c0 = CoordinatorClient(s.address, token=TOKEN, retry_for_s=1)
    c1 = CoordinatorClient(s.address, token=TOKEN, retry_for_s=1)
    try:
        assert c0.open_job(job, "a")[0] == 0
        assert c0.open_job(job, "b")[0] == 1
        with pytest.raises(StaleGeneration) as stale:
            c0.begin_save(
                SaveRef(job, 1, 0, 0, 1),
                [plan("x", b"a")],
                state=None,
                metadata=None,
                allow_divergent=False,
                keep_last=0,
                timeout_s=5,
            )
        assert "replica" in str(stale.value) and not isinstance(stale.value, DivergentReplicas)

        # Ranks that disagree on a key's dtype: divergent, in words that do not say so.
        out: dict[int, BaseException] = {}

        def rank(r: int, c: CoordinatorClient) -> None:
            try:
                c.begin_save(
                    SaveRef(job, 2, 1, r, 2),
                    [plan("x", b"\0" * 8, dtype=("uint8", "int8")[r])],
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
            e = out.get(r)
            assert isinstance(e, DivergentReplicas), out
            assert "dtype" in str(e) and f"rank {r}/2" in str(e), e
    finally:
        c0.close()
        c1.close()
        s.stop()


def test_the_class_comes_from_an_allow_list() -> None:
    code = grpc.StatusCode.FAILED_PRECONDITION
    # The metadata decides, whatever the message says.
    e = error_from(code, "job 'x': divergent replica", ((ERROR_KEY, "StaleGeneration"),))
    assert type(e) is StaleGeneration
    # A name outside ckptd.errors is never looked up: the status code decides.
    for name in ("Exception", "SystemExit", "os.system", "__import__('os')", "KeyError"):
        e = error_from(code, "job 'x': refused", ((ERROR_KEY, name),))
        assert type(e) is SaveFailed, name
