"""Randomized: interleaved incremental saves, rollbacks, retention and gc (seeded, bounded).

Real files and the real embedded coordinator, with an 8 KiB hash block so that each
32 KiB tensor is 4 blocks. Each seed runs a bounded sequence of operations, each drawn at
random: a save (a random share of the tensors changed, from none to all, or a few rows of
some of them: only those blocks are written, the entry borrows the rest from the steps
that hold them, several steps for one entry), a rollback (load an earlier committed step: the next saves descend from
it, so branches appear), retention from storage (`ckpt.apply_retention`), `ckptctl gc`
(with --keep-last, sometimes --abandoned), and reopening the Checkpointer with another
keep_last (the coordinator's own retention). After every operation every committed step
must verify (every byte it needs, borrowed ones included) and load bit-identical to what
was saved as it; a lost lender shows up as a step that no longer does.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from ckpt_testutil import tensor_raw
from coordinator_fixtures import ckptctl_json, wait_for

import ckpt
from ckptd import knobs
from ckptd.coordinator import retention
from ckptd.format import checkpoint as ckfmt
from ckptd.storage import open_storage

N_TENSORS = 6
OPS = 40
BLOCK = 8192  # 16 rows of a tensor


def fresh(rng: random.Random) -> torch.Tensor:
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    return torch.randn(64, 128, generator=g)  # 32 KiB


def check_all(job: Path, saved: dict[int, dict[str, torch.Tensor]], where: str) -> list[int]:
    st = open_storage(str(job))
    steps = ckfmt.committed_steps(st)
    for s in steps:
        rep = ckfmt.verify_checkpoint(st, s)
        assert rep.ok, f"{where}: step {s} does not verify: {rep.problems}"
        got = {f"t{i}": torch.zeros(64, 128) for i in range(N_TENSORS)}
        ckpt.load(got, str(job), step=s, fallback=False)
        for k, v in saved[s].items():
            assert tensor_raw(got[k]) == tensor_raw(v), f"{where}: step {s} key {k} differs"
    return steps


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_interleaved_saves_retention_and_gc_keep_every_step_whole(
    tmp_path: Path, seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = random.Random(seed)
    held: list[int] = []  # lenders the rule kept from removal (so the run tested that)
    real = retention.keep_borrowed

    def keep_borrowed(*a, **kw):  # noqa: ANN002, ANN003, ANN202
        got = real(*a, **kw)
        held.extend(got)
        return got

    monkeypatch.setattr(retention, "keep_borrowed", keep_borrowed)
    with knobs.override(block_size=BLOCK):
        _run(tmp_path, seed, rng, held)


def _run(tmp_path: Path, seed: int, rng: random.Random, held: list[int]) -> None:
    job = tmp_path / "job"
    state = {f"t{i}": fresh(rng) for i in range(N_TENSORS)}
    saved: dict[int, dict[str, torch.Tensor]] = {}
    next_step = 1
    borrowed = partial = 0
    c = ckpt.Checkpointer(job, incremental=True)
    try:
        for op_no in range(OPS):
            op = rng.choices(
                ["save", "rollback", "retention", "gc", "reopen"], weights=[10, 2, 2, 2, 1]
            )[0]
            where = f"seed {seed} op {op_no} ({op})"
            committed = ckfmt.committed_steps(open_storage(str(job)))
            if op == "save" or not committed:
                shares: list[float | str] = [0.0, 0.2, 0.5, 1.0, "rows"]
                share = rng.choice(shares)
                for k in state:
                    if share == "rows":  # a sparse update: a few rows, so a few blocks
                        if rng.random() < 0.5:
                            state[k] = state[k].clone()
                            for row in rng.sample(range(64), rng.randint(1, 3)):
                                state[k][row] += 1.0
                    elif isinstance(share, float) and rng.random() < share:
                        state[k] = fresh(rng)
                r = c.save(state, next_step, blocking=True).wait()
                assert r is not None
                borrowed += r.borrowed_bytes
                saved[next_step] = {k: v.clone() for k, v in state.items()}
                partial += _block_borrows(job, next_step)
                next_step += 1
                c.wait()
            elif op == "rollback":
                s = rng.choice(committed)
                got = {k: torch.zeros_like(v) for k, v in state.items()}
                c.load(got, step=s)
                state = got
            elif op == "retention":
                ckpt.apply_retention(open_storage(str(job)), rng.randint(1, 3))
            elif op == "gc":
                args = ["gc", str(job), "--keep-last", str(rng.randint(1, 3))]
                if rng.random() < 0.5:
                    args.append("--abandoned")
                ckptctl_json(*args)
            else:
                c.close()
                c = ckpt.Checkpointer(job, incremental=True, keep_last=rng.choice([None, 1, 2]))
            # The coordinator's retention runs after a commit, in the background: let it end.
            c.wait()
            _settle(c)
            check_all(job, saved, where)
    finally:
        c.close()
    check_all(job, saved, f"seed {seed} at the end")
    assert borrowed > 0, "the sequence never borrowed: it tested nothing incremental"
    assert held, "no removal ever met a lender: the sequence tested nothing of retention"
    assert partial, "no save borrowed only some blocks of an entry: block references untested"


def _block_borrows(job: Path, step: int) -> int:
    """How many entries of a step borrow only some of their blocks."""
    st = open_storage(str(job))
    m = ckfmt.read_manifest(st, step)
    index = ckfmt.read_index(st, m, m.shards[0], max_entries=1000)
    return sum(1 for e in index.entries if e.borrowed_blocks)


def _settle(c: ckpt.Checkpointer) -> None:
    """Wait for the embedded coordinator's background work (retention after a commit)."""
    embedded = c._conn.embedded
    core = embedded.core if embedded is not None else None
    if core is not None:
        wait_for(lambda: not core._background, 20, "the coordinator's background retention")
