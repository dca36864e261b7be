"""Plug-ins that let existing training code save through ckptd with a line.

    ckpt.integrations.dcp        torch.distributed.checkpoint StorageWriter / StorageReader
    ckpt.integrations.lightning  a Lightning CheckpointIO (needs `lightning`)
    ckpt.integrations.hf         Hugging Face accelerate save/load hooks (needs `accelerate`)

Import the submodule you use; this package imports none of the optional frameworks, so
`import ckpt` never needs them (`pip install ckptd[integrations]` installs them).
"""

__all__: list[str] = []
