"""The Lightning CheckpointIO plug-in, with a real Trainer and a tiny LightningModule on CPU.

Skipped when lightning is not installed (pip install ckptd[integrations]).
"""

from __future__ import annotations

import json
import pathlib
from pathlib import Path

import pytest
import torch
from coordinator_fixtures import ckptctl

import ckpt
from ckptd.errors import UnsupportedValue

L = pytest.importorskip("lightning.pytorch")
from ckpt.integrations.lightning import CkptdCheckpointIO, job_for  # noqa: E402

# Lightning's advice about dataloader workers, loggers and such is not under test.
pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning"),
]


class Tiny(L.LightningModule):
    def __init__(self, width: int = 4, tag: object = "plain"):
        super().__init__()
        self.save_hyperparameters()
        self.layer = torch.nn.Linear(width, 1)

    def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):  # noqa: ANN201
        opt = torch.optim.Adam(self.parameters(), lr=0.05)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)]


def loader() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 4, generator=g)
    return torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4
    )


def _tree(root: Path) -> str:
    """Every path under root with its size, for an assertion message."""
    return "\n".join(
        f"{p.relative_to(root)}{'/' if p.is_dir() else f' ({p.stat().st_size} B)'}"
        for p in sorted(root.rglob("*"))
    )


def trainer(tmp_path: Path, epochs: int, io: CkptdCheckpointIO, **kw) -> L.Trainer:  # noqa: ANN003
    ckpt_cb = L.callbacks.ModelCheckpoint(
        dirpath=tmp_path / "ckpts", save_top_k=1, monitor="loss", save_last=True
    )
    return L.Trainer(
        max_epochs=epochs,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        plugins=[io],
        callbacks=[ckpt_cb],
        default_root_dir=tmp_path,
        **kw,
    )


def test_fit_saves_verified_ckptd_checkpoints_and_resumes(tmp_path: Path) -> None:
    io = CkptdCheckpointIO()
    torch.manual_seed(0)
    model = Tiny()
    t = trainer(tmp_path, 3, io)
    t.fit(model, loader())
    last = tmp_path / "ckpts" / "last.ckpt"
    assert (last / "step-000000000012" / "MANIFEST.json").exists(), sorted(last.rglob("*"))
    # top-1 by loss: the older best checkpoints were removed through remove_checkpoint.
    # '=' is not in ckptd names. Exactly one best checkpoint is left (the others went through
    # remove_checkpoint); which epoch it is depends only on the losses, so it is the one the
    # callback holds as best.
    cb = next(c for c in t.callbacks if isinstance(c, L.callbacks.ModelCheckpoint))
    best = sorted(p.name for p in (tmp_path / "ckpts").iterdir() if p.name != "last.ckpt")
    assert best == [Path(job_for(cb.best_model_path)).name], _tree(tmp_path / "ckpts")
    rc, out, err = ckptctl("verify", str(last))
    assert rc == 0 and "OK" in out, out + err
    m = json.loads((last / "step-000000000012" / "MANIFEST.json").read_text())
    assert m["metadata"]["lightning"]["global_step"] == 12
    saved = ckpt.load({}, last).state
    assert saved["hyper_parameters"] == {"width": 4, "tag": "plain"}
    assert torch.equal(saved["state_dict"]["layer.weight"], model.layer.weight.detach())
    # Resume: weights, optimizer and loop state come back through load_checkpoint.
    model2 = Tiny()
    t2 = trainer(tmp_path / "resume", 4, io)
    t2.fit(model2, loader(), ckpt_path=str(last))
    assert t2.global_step == 16  # 12 restored + one more epoch of 4 batches
    direct = io.load_checkpoint(last)
    assert direct["global_step"] == 12 and direct["epoch"] == 2
    assert direct["optimizer_states"][0]["param_groups"][0]["betas"] == (0.9, 0.999)


def test_values_that_need_pickle_are_refused_by_key_or_converted_when_asked(tmp_path: Path) -> None:
    io = CkptdCheckpointIO()
    ck = {"global_step": 1, "hyper_parameters": {"root": pathlib.PurePosixPath("/data")}}
    with pytest.raises(UnsupportedValue, match=r"hyper_parameters/root.*unsupported='str'"):
        io.save_checkpoint(ck, tmp_path / "a.ckpt")
    assert not (tmp_path / "a.ckpt" / "step-000000000001" / "MANIFEST.json").exists()
    CkptdCheckpointIO(unsupported="str").save_checkpoint(ck, tmp_path / "b.ckpt")
    assert io.load_checkpoint(tmp_path / "b.ckpt")["hyper_parameters"] == {"root": "/data"}
    CkptdCheckpointIO(unsupported="drop").save_checkpoint(
        {**ck, "xs": [1, pathlib.PurePosixPath("/x")]}, tmp_path / "c.ckpt"
    )
    got = io.load_checkpoint(tmp_path / "c.ckpt")
    assert got["hyper_parameters"] == {} and got["xs"] == [1, None]


def test_overwriting_a_path_commits_a_new_step_and_retires_the_old(tmp_path: Path) -> None:
    io = CkptdCheckpointIO()
    path = tmp_path / "last.ckpt"
    io.save_checkpoint({"global_step": 5, "w": torch.ones(2)}, path)
    io.save_checkpoint({"global_step": 5, "w": torch.zeros(2)}, path)
    assert torch.equal(io.load_checkpoint(path)["w"], torch.zeros(2))
    steps = sorted(p.name for p in path.iterdir() if p.name.startswith("step-"))
    assert steps == ["step-000000000006"], steps  # committed as 6, then step 5 retired
    io.remove_checkpoint(path)
    assert not path.exists()
