"""Two hosts, for real: network namespaces joined by a veth pair (tests/netns.py).

Every byte and RPC between the hosts crosses a real network interface: torchrun's c10d
rendezvous on host A's cable address, gloo over the cable (GLOO_SOCKET_IFNAME), and the
coordinator, either zero-config (rank 0 on host A hosts it; host B reaches it at the
address it advertises) or `ckptd serve` with a token and TLS on a third host that both
reach by address over a bridge. The checkpoint directory is this machine's filesystem,
which both namespaces see: the stand-in for a parallel filesystem.

The story of docs/deploy.md's multi-node recipe: host B dies whole (its worker SIGKILLed
in the middle of writing its shard, its torchrun agent with it), host A's agent restarts
its worker and waits in the rendezvous, host B is started again, and the job resumes and
ends bit-identical to an uninterrupted run. Skipped, with the reason, where namespaces
cannot be made (not root, no `ip`).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import netns
import pytest
from coordinator_fixtures import REPO, TOKEN, child_env, make_certs, read_catalog

REASON = netns.skip_reason()
pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.timeout(300),
    pytest.mark.skipif(REASON is not None, reason=REASON or ""),
]

TRAIN = REPO / "examples" / "train_gpt.py"
RDZV_PORT = "29400"  # each host has ports of its own: nothing else listens there


@pytest.fixture
def two_hosts() -> object:
    with netns.hosts() as hs:
        yield hs


@pytest.fixture
def three_hosts() -> object:
    with netns.hosts(service=True) as hs:
        yield hs


def torchrun(
    host: netns.Host, rdzv: netns.Host, script: list[str], *, monitor_s: float = 0.1
) -> list[str]:
    """One node of a 2-node torchrun on `host`, the rendezvous on `rdzv`'s cable address."""
    return host.argv(
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "2",
        "--nproc-per-node",
        "1",
        "--rdzv-backend",
        "c10d",
        "--rdzv-id",
        "two-hosts",
        "--rdzv-endpoint",
        f"{rdzv.addr}:{RDZV_PORT}",
        # The rendezvous host is named by address, which the host name here does not
        # resolve to: say which node hosts it. --local-addr: the address the other node
        # reaches this one by (torchrun would use the host name's), which also orders
        # the nodes (A's sorts first: rank 0).
        "--rdzv-conf",
        f"is_host={int(host is rdzv)},join_timeout=120",
        "--local-addr",
        host.addr,
        "--max-restarts",
        "3",
        "--monitor-interval",
        str(monitor_s),
        *script,
    )


def node_env(**extra: str) -> dict[str, str]:
    return child_env(
        GLOO_SOCKET_IFNAME="veth0",  # gloo would take the host name's address (loopback)
        # A store per rendezvous round (rank 0's worker hosts it): a replaced node's worker
        # must not find the previous round's keys (pytorch/pytorch#167288).
        TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
        **extra,
    )


def load_demo() -> ModuleType:
    spec = importlib.util.spec_from_file_location("ckpt_demo_2h", REPO / "examples" / "demo.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def _state(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def _worker(host: netns.Host) -> int | None:
    for pid in host.pids():
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(c.endswith(b"train_gpt.py") for c in cmd) and b"torch.distributed.run" not in cmd:
            return pid
    return None


def _wait_for(pred: object, timeout: float, what: str, logs: object) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()  # type: ignore[operator]
        if got:
            return got
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}\n{logs()}")  # type: ignore[operator]


def test_zero_config_coordinator_is_reached_from_the_other_host(
    two_hosts: list[netns.Host],
) -> None:
    """Rank 0 advertises the address the other host reaches it by, not the host name's."""
    a, b = two_hosts
    host = subprocess.Popen(
        a.argv(
            sys.executable,
            "-c",
            "import sys; from ckpt._embedded import EmbeddedCoordinator\n"
            "e = EmbeddedCoordinator(sys.argv[1], host='0.0.0.0')\n"
            "print(e.address, e.token, flush=True); sys.stdin.read()",
            "/tmp/ckptd-two-hosts-unused/job",
        ),
        env=node_env(MASTER_ADDR=a.addr, CKPTD_CATALOG_DIR="/tmp/ckptd-two-hosts-unused/cat"),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert host.stdout is not None
        address, token = host.stdout.readline().split()
        assert address.startswith(f"{a.addr}:"), address
        reach = subprocess.run(
            b.argv(
                sys.executable,
                "-c",
                "import sys; from ckptd.server.client import CoordinatorClient\n"
                "c = CoordinatorClient(sys.argv[1], token=sys.argv[2], retry_for_s=5)\n"
                "print(c.open_job('/tmp/ckptd-two-hosts-unused/job', 'a1'))",
                address,
                token,
            ),
            env=node_env(),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert reach.returncode == 0, reach.stderr[-3000:]
        assert "(0, 'job')" in reach.stdout, reach.stdout
    finally:
        host.kill()
        host.communicate()


@pytest.mark.slow  # about 100 s: two launches, a rendezvous wait, and the reference run
def test_host_b_dies_mid_save_is_started_again_and_the_job_ends_bit_identical(
    two_hosts: list[netns.Host], tmp_path: Path, tally: Any
) -> None:
    a, b = two_hosts
    demo = load_demo()
    cfg = demo.Config(
        tmp_path, steps=24, save_every=4, crash_at=16, d_model=32, layers=2, lease_s=2
    )
    job, out = tmp_path / "gpt", tmp_path / "gpt.jsonl"
    script = [str(TRAIN), "--ckpt", str(job), "--out", str(out), *cfg.train_args()]
    logs = {n: tmp_path / f"{n}.log" for n in ("a", "b0", "b1")}

    def tails() -> str:
        return "\n".join(f"--- {n}\n{p.read_text()[-4000:]}" for n, p in logs.items() if p.exists())

    def start(host: netns.Host, log: str, extra: list[str], **kw: float) -> subprocess.Popen[bytes]:
        with open(logs[log], "wb") as f:
            return subprocess.Popen(
                torchrun(host, a, script + extra, **kw),
                env=node_env(),
                stdout=f,
                stderr=subprocess.STDOUT,
                cwd=REPO,
            )

    node_a = start(a, "a", [])
    # B's agent looks at its worker only every 5 s: it is still there, unaware, when the
    # whole host is killed right after its worker's crash point fired.
    node_b = start(b, "b0", ["--crash-at", str(cfg.crash_at)], monitor_s=5.0)
    try:
        with tally.fault("two-hosts-host-killed-mid-save"):
            _wait_for(
                lambda: "kill -9 of this rank planned" in logs["b0"].read_text(),
                150,
                "host B's rank 1 to reach the save of the crash step",
                tails,
            )
            worker = _wait_for(lambda: _worker(b), 10, "host B's worker", tails)
            _wait_for(
                lambda: _state(worker) in (None, "Z"),  # type: ignore[arg-type]
                60,
                "host B's worker to die at its crash point (rank.mid_write)",
                tails,
            )
            killed = b.kill_all()  # the agent and anything else of host B
            node_b.wait(10)
            assert killed and not b.pids()
            node_b = start(b, "b1", [])  # host B started again: a new agent, restart count 0
            assert node_a.wait(200) == 0, tails()
            assert node_b.wait(60) == 0, tails()
    finally:
        for p in (node_a, node_b):
            p.kill()
    attempts = [json.loads(x) for x in out.read_text().splitlines()]
    (last,) = attempts  # rank 0's first launch died with its all-reduce
    assert last["resumed_from"] == 12 and last["saves"] == [16, 20, 24], (attempts, tails())
    assert last["generation"] == 1, (attempts, tails())
    a_log = logs["a"].read_text()
    assert "skipping step 16: incomplete: no MANIFEST.json" in a_log, tails()
    # One launch after the kill, and it went through: host A's agent restarted its worker
    # because a node joined (not counted by torchrun: the new launch is still "restart 0",
    # as is the new host B's), and it was a new attempt all the same.
    assert a_log.count("resumed from step 12") == 1, tails()
    catalog = read_catalog(job / ".ckptd" / "catalog.sqlite")
    assert catalog[24]["status"] == "COMMITTED" and catalog[24]["generation"] == 1

    # The same training, uninterrupted (one host, the demo's own launch): bit for bit.
    ref = tmp_path / "gpt-uninterrupted"
    rc, _ = demo.torchrun(cfg, ref, tmp_path / "uninterrupted.log", crash=False, show=False)
    assert rc == 0, (tmp_path / "uninterrupted.log").read_text()[-4000:]
    cmp = demo.compare(job, ref, cfg.steps)
    assert not cmp["differ"], cmp["differ"]
    assert float(cmp["loss_a"]).hex() == float(cmp["loss_b"]).hex()
    assert cmp["model_tensors"] > 0 and cmp["chunks"] > 0


SERVED = """
import datetime, json, os, sys
import torch, torch.distributed as dist
import ckpt

job, out = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
rank = dist.get_rank()
ca = open(os.environ["TWO_HOSTS_CA"], "rb").read()  # CKPTD_ADDRESS / CKPTD_TOKEN: from the env
w = torch.arange(6, dtype=torch.float32) + 10 * rank
with ckpt.Checkpointer(job, timeout_s=60, tls_root_cert=ca) as cp:
    for step in (1, 2):
        cp.save({"w": ckpt.PerRank(w * step), "step": step}, step).wait()
    address = cp.address
dist.barrier()
state = {"w": ckpt.PerRank(torch.zeros(6)), "step": 0}
with ckpt.Checkpointer(job, timeout_s=60, tls_root_cert=ca) as cp:
    resumed = cp.resume(state)
with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    json.dump({"address": address, "resumed": resumed, "step": state["step"],
               "w": state["w"].value.tolist(), "expected": (w * 2).tolist()}, f)
dist.destroy_process_group()
"""


def test_ckptd_serve_with_token_and_tls_on_a_third_host(
    three_hosts: list[netns.Host], tmp_path: Path
) -> None:
    a, b, s = three_hosts
    pki = tmp_path / "pki"
    if make_certs(pki, server_names=f"IP:{s.addr}") is None:
        pytest.skip("no openssl CLI to make test certificates")
    root, out = tmp_path / "root", tmp_path / "out"
    out.mkdir()
    (tmp_path / "token").write_text(TOKEN)
    (tmp_path / "served.py").write_text(SERVED)
    port_file = tmp_path / "port"
    serve_log = tmp_path / "serve.log"
    with open(serve_log, "wb") as f:
        server = subprocess.Popen(
            s.argv(
                sys.executable,
                "-m",
                "ckptd.cli.serve",
                "serve",
                "--root",
                str(root),
                "--create-root",
                "--listen",
                f"{s.addr}:7070",
                "--token-file",
                str(tmp_path / "token"),
                "--tls-cert",
                str(pki / "server.pem"),
                "--tls-key",
                str(pki / "server.key"),
                "--lease",
                "10",
                "--port-file",
                str(port_file),
            ),
            env=child_env(),
            stdout=f,
            stderr=subprocess.STDOUT,
        )
    nodes: list[subprocess.Popen[str]] = []
    try:
        _wait_for(port_file.exists, 60, "ckptd serve to listen", serve_log.read_text)
        env = node_env(
            CKPTD_ADDRESS=f"{s.addr}:7070", CKPTD_TOKEN=TOKEN, TWO_HOSTS_CA=str(pki / "ca.pem")
        )
        script = [str(tmp_path / "served.py"), str(root / "job"), str(out)]
        nodes = [
            subprocess.Popen(
                torchrun(h, a, script),
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for h in (a, b)
        ]
        logs = [p.communicate(timeout=180)[0] for p in nodes]
        assert [p.returncode for p in nodes] == [0, 0], "\n".join(x[-4000:] for x in logs)
    finally:
        for p in (*nodes, server):
            p.kill()
        server.communicate()
    results = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    for r in results:
        assert r["address"] == f"{s.addr}:7070"
        assert r["resumed"] == 2 and r["step"] == 2 and r["w"] == r["expected"], results
    assert results[0]["w"] != results[1]["w"]  # each rank got its own shard back
    catalog = read_catalog(root / ".ckptd" / "catalog.sqlite")
    assert {catalog[1]["status"], catalog[2]["status"]} == {"COMMITTED"}, catalog
