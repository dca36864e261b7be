"""Every ckptctl command and option that docs/cli.md documents does what the doc says.

The doc's synopsis block is parsed (not a list kept here): each `ckptctl COMMAND` line,
its options, their metavars and choices, `CONNECTION` expanded from the paragraph that
defines it. Each command then runs with each documented option (each choice of a choice),
with and without --json, against real jobs: one saved with ckpt.save, one committed
through a real mutual-TLS coordinator (for --coordinator and its connection options).
Each also runs against a missing path and a regular file, and each option that takes a value without it.
Exit codes are the doc's table (0 ok, 1 a problem, 2 usage); every --json document parses,
has command, an absolute path and ok; one that is not ok has error and exit_code.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from coordinator_fixtures import REPO, TOKEN, ServerThread, finished, make_certs

import ckpt
from ckptd.cli import ckptctl as cli
from ckptd.server import ServerOptions

pytestmark = pytest.mark.timeout(300)
DOC = (REPO / "docs" / "cli.md").read_text()
OPTION = re.compile(r"(--[a-z0-9-]+)(?:\s+([A-Z_]+|[a-z0-9]+(?:\|[a-z0-9]+)+))?")


def connection_options() -> list[tuple[str, str | None]]:
    """The options the doc's `CONNECTION` paragraph names, with their metavars."""
    para = DOC[DOC.index("`CONNECTION` is") :].split("\n\n", 1)[0]
    return [(o, m or None) for o, m in OPTION.findall(para)]


def synopsis() -> dict[str, dict[str, Any]]:
    """{command: {"positional": [...], "options": {flag: metavar}, "required": {flags}}}."""
    block = re.search(r"```sh\n(ckptctl .*?)```", DOC, re.S)
    assert block, "docs/cli.md lost its synopsis block"
    commands: dict[str, str] = {}
    current = ""
    for line in block.group(1).splitlines():
        m = re.match(r"ckptctl (\w+)\s+(.*)", line)
        if m:
            current = m.group(1)
            commands[current] = m.group(2)
        else:
            commands[current] += " " + line.strip()
    out = {}
    for name, text in commands.items():
        text = text.replace(
            "CONNECTION", " ".join(f"{o} {m or ''}" for o, m in connection_options())
        )
        options = {o: m or None for o, m in OPTION.findall(text)}
        options["--json"] = None  # "Every command takes --json"
        outside = re.sub(r"\[[^\]]*\]", " ", text)  # what is not in [...] is required
        required = {o for o, _ in OPTION.findall(outside)}
        bare = re.sub(OPTION, " ", outside)
        positional = re.findall(r"\b[A-Z][A-Z_]+\b", bare)
        exclusive = [  # [--a X | --b]: one or the other
            [o for o, _ in OPTION.findall(group)]
            for group in re.findall(r"\[([^\]]*\s\|\s[^\]]*)\]", text)
        ]
        out[name] = {
            "positional": positional,
            "options": options,
            "required": required,
            "exclusive": exclusive,
        }
    return out


SYNOPSIS = synopsis()


def test_the_synopsis_is_the_parser() -> None:
    """Each documented command and option exists, and each the parser has is documented."""
    import argparse

    (sub,) = (a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert set(SYNOPSIS) == set(sub.choices)
    for name, spec in SYNOPSIS.items():
        parser = sub.choices[name]
        flags = {s for a in parser._actions for s in a.option_strings if s.startswith("--")}
        assert set(spec["options"]) == flags - {"--help"}, name
        assert spec["positional"][0] == "PATH", name
        assert all(len(g) == 2 for g in spec["exclusive"]), (name, spec["exclusive"])
        for a in parser._actions:
            if a.choices and a.option_strings:  # documented as a|b|c
                assert spec["options"][a.option_strings[0]] == "|".join(a.choices), name


@pytest.fixture(autouse=True)
def _no_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in ("RANK", "WORLD_SIZE", "CKPTD_ADDRESS", "CKPTD_TOKEN", "CKPT_PATH"):
        monkeypatch.delenv(k, raising=False)


def state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {
        "model": {"w": torch.randn(8, 4, generator=g), "b": torch.randn(4, generator=g)},
        "step": step,
    }


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A job saved with ckpt.save (steps 1, 2), its mirror copy, and a job committed through
    a mutual-TLS coordinator with a token (steps 1, 2)."""
    tmp = tmp_path_factory.mktemp("walk")
    certs = make_certs(tmp / "pki")
    if certs is None:
        pytest.skip("no openssl CLI to make test certificates")
    job = tmp / "job"
    for step in (1, 2):
        ckpt.save(state(step), str(job), step=step)
    shutil.copytree(job, tmp / "mirror", ignore=shutil.ignore_patterns(".ckptd"))
    options = ServerOptions(
        token=TOKEN,
        tls_cert=certs["server.pem"],
        tls_key=certs["server.key"],
        tls_client_ca=certs["ca.pem"],
    )
    server = ServerThread(tmp / "root", options=options)
    served = tmp / "root" / "served"
    try:
        with ckpt.Checkpointer(
            str(served),
            coordinator=server.address,
            token=TOKEN,
            tls_root_cert=certs["ca.pem"],
            tls_client_cert=(certs["client.key"], certs["client.pem"]),
        ) as cp:
            for step in (1, 2):
                finished(cp.save(state(step), step))
        pem = {}
        for name in ("ca.pem", "client.pem", "client.key"):
            pem[name] = tmp / "pki" / name
        yield {"tmp": tmp, "job": job, "served": served, "server": server, "pem": pem}
    finally:
        server.stop(0.2)


def value(flag: str, metavar: str, w: dict[str, Any], out: Path, choice: str = "") -> str:
    """A value for a documented option that a real job accepts."""
    if choice:
        return choice
    return {
        ("--step", "N"): "2",
        ("--keep-last", "N"): "1",
        ("--norm-jump", "FACTOR"): "3",
        ("--to", "OUT"): str(out),
        ("--keys", "PATTERN"): "model",
        ("--mirror", "URL"): str(w["tmp"] / "mirror"),
        ("--coordinator", "ADDR"): w["server"].address,
        ("--token", "T"): TOKEN,
        ("--tls-root-cert", "PEM"): str(w["pem"]["ca.pem"]),
        ("--tls-client-cert", "PEM"): str(w["pem"]["client.pem"]),
        ("--tls-client-key", "PEM"): str(w["pem"]["client.key"]),
    }[(flag, metavar)]


CONNECTION = {o for o, _ in connection_options()} | {"--coordinator"}


def invocations(name: str, w: dict[str, Any], tmp: Path) -> list[tuple[str, list[str]]]:
    """(what, argv after PATH) for the command alone and with each documented option."""
    spec = SYNOPSIS[name]
    n = iter(range(10_000))

    def out(fmt: str = "torch") -> Path:
        return tmp / f"out-{next(n)}.{fmt}"

    def base(fmt: str = "torch") -> list[str]:
        argv = [{"STEP_A": "1", "STEP_B": "2"}[p] for p in spec["positional"][1:]]
        for flag in sorted(spec["required"]):
            metavar = spec["options"][flag]
            if "|" in metavar:
                argv += [flag, fmt]
            else:
                argv += [flag, value(flag, metavar, w, out(fmt))]
        return argv

    runs = [("alone", base())]
    for flag, metavar in spec["options"].items():
        if flag in spec["required"] and not (metavar and "|" in metavar):
            continue
        if flag == "--json":
            continue  # every run goes with and without it
        if flag in CONNECTION and flag != "--coordinator":
            continue  # they go with --coordinator, all together
        if flag == "--coordinator":
            conn = [x for o, m in connection_options() for x in (o, value(o, m or "", w, tmp))]
            runs.append((flag, [*base(), flag, value(flag, "ADDR", w, tmp), *conn]))
        elif metavar and "|" in metavar:
            for choice in metavar.split("|"):
                if flag in spec["required"]:
                    runs.append((f"{flag} {choice}", base(choice)))
                else:
                    runs.append((f"{flag} {choice}", [*base(), flag, choice]))
        elif metavar:
            fmt = "zarr" if flag == "--zarr-keep-bfloat16" else "torch"
            runs.append((flag, [*base(fmt), flag, value(flag, metavar, w, out(fmt))]))
        else:
            fmt = "zarr" if flag == "--zarr-keep-bfloat16" else "torch"
            runs.append((flag, [*base(fmt), flag]))
    return runs


def check_json(out: str, rc: int, path: str, name: str, *, ok: bool) -> dict[str, Any]:
    doc = json.loads(out)  # exactly one document
    assert doc["command"] == name and doc["path"] == path, doc
    assert doc["ok"] is ok, doc
    if not ok:
        assert isinstance(doc["error"], str) and doc["error"] and doc["exit_code"] == rc, doc
    return doc


def exit_of(name: str, argv: list[str]) -> int:
    """What the doc's table says a run against a real job exits with."""
    # diff --exit-code: 1 when the steps differ (1 and 2 do), and ok stays true.
    return 1 if name == "diff" and "--exit-code" in argv else 0


@pytest.mark.parametrize("name", sorted(SYNOPSIS))
def test_every_documented_option_against_a_real_job(
    name: str, world: dict[str, Any], ckptctl, tmp_path: Path
) -> None:
    if name == "restore":
        pytest.importorskip("tensorstore")  # --format zarr
    for what, argv in invocations(name, world, tmp_path):
        if "--coordinator" in argv:
            job = world["served"]  # committed through the coordinator
        else:  # a fresh copy: gc removes things
            job = tmp_path / f"job-{len(list(tmp_path.iterdir()))}"
            shutil.copytree(world["job"], job)
        for json_flag in ([], ["--json"]):
            rc, out, err = ckptctl(name, job, *argv, *json_flag)
            expected = exit_of(name, argv)
            assert rc == expected, (name, what, argv, json_flag, out, err)
            if json_flag:
                check_json(out, rc, str(job), name, ok=True)
                assert err == "", (name, what, err)
            else:
                assert out and "error:" not in err, (name, what, err)
            if "--to" in argv:  # the next run writes it again (--force aside)
                target = Path(argv[argv.index("--to") + 1])
                shutil.rmtree(target) if target.is_dir() else target.unlink()


@pytest.mark.parametrize("bad", ["missing", "a file"])
@pytest.mark.parametrize("name", sorted(SYNOPSIS))
def test_every_documented_option_against_a_path_that_is_no_job(
    name: str, bad: str, world: dict[str, Any], ckptctl, tmp_path: Path, tally
) -> None:
    path = tmp_path / "no-such-job"
    if bad == "a file":
        path.write_text("notes, not a job")
    for what, argv in invocations(name, world, tmp_path):
        with tally.bad_input(f"ckptctl {name} {what}: path {bad}"):
            rc, out, err = ckptctl(name, path, *argv, "--json")
            assert rc == 1, (name, what, out, err)
            doc = check_json(out, rc, str(path), name, ok=False)
            assert str(path) in doc["error"] and err.strip() == f"error: {doc['error']}"
            rc, out, err = ckptctl(name, path, *argv)
            assert rc == 1 and out == "" and err.startswith("error: "), (name, what, out, err)
            assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert path.exists() == (bad == "a file")


@pytest.mark.parametrize("name", sorted(SYNOPSIS))
def test_usage_errors_exit_2(name: str, world: dict[str, Any], ckptctl, tmp_path: Path) -> None:
    """An option without its value, a choice not among the documented ones, an unknown
    option: exit 2, and with --json either nothing on stdout (the parser's usage message
    on stderr) or a failure document with exit_code 2."""
    job = tmp_path / "job"
    shutil.copytree(world["job"], job)
    spec = SYNOPSIS[name]
    runs = [["--frobnicate"]]
    for flag, metavar in spec["options"].items():
        if metavar:
            runs.append([flag])  # its value left out
        if metavar and "|" in metavar:
            runs.append([flag, "bogus"])
    for group in spec["exclusive"]:  # both of `[--a | --b]`
        runs.append([x for o in group for x in (o, *(["2"] if spec["options"][o] else []))])
    if name == "gc":
        runs.append(["--keep-last", "0"])  # the doc's example of a value that cannot be right
    for argv in runs:
        rc, out, err = ckptctl(name, job, *argv, "--json")
        assert rc == 2, (name, argv, out, err)
        assert out == "" or check_json(out, rc, str(job), name, ok=False), (name, argv)
        assert "Traceback" not in err


def test_restore_onto_an_existing_target_needs_force(world: dict[str, Any], ckptctl, tmp_path):
    target = tmp_path / "exists.pt"
    target.write_bytes(b"old")
    argv = ("restore", world["job"], "--to", target, "--format", "torch", "--json")
    rc, out, _ = ckptctl(*argv)
    assert (
        rc == 1 and "--force" in check_json(out, 1, str(world["job"]), "restore", ok=False)["error"]
    )
    rc, out, _ = ckptctl(*argv, "--force")
    assert rc == 0 and target.read_bytes() != b"old"


def test_relative_paths_are_absolute_in_every_document(
    world: dict[str, Any], ckptctl, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(world["tmp"])
    for name in ("list", "inspect", "verify"):
        rc, out, err = ckptctl(name, "job", "--json")
        assert rc == 0 and json.loads(out)["path"] == str(world["job"]), (name, err)
    rc, out, _ = ckptctl("gc", "nope", "--json")
    assert rc == 1 and json.loads(out)["path"] == os.path.join(str(world["tmp"]), "nope")
    served = os.path.relpath(world["served"])
    conn = [x for o, m in connection_options() for x in (o, value(o, m or "", world, Path()))]
    rc, out, err = ckptctl(
        "list", served, "--coordinator", world["server"].address, *conn, "--json"
    )
    assert rc == 0, err
    doc = json.loads(out)
    assert doc["path"] == str(world["served"]) and [s["step"] for s in doc["steps"]] == [1, 2]
