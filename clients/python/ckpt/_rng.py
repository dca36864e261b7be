"""RNGState: the process's random number generators as one stateful value.

Put it in the state you save (`{"rng": ckpt.RNGState(data_gen)}`, or
`ckpt.PerRank(ckpt.RNGState())` when ranks are seeded differently) and a resumed run draws
the same numbers as an uninterrupted one: dropout masks, random crops, shuffles. Its
state_dict() is called by the save itself, so what is saved is the generators' state at
that moment, not when the state dict was built. Stored as tensors, arrays and plain
values (no pickle): torch's CPU generator, every initialized CUDA device's, numpy's global
RandomState, Python's `random`, and any torch.Generator passed in.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


class RNGState:
    def __init__(self, *generators: torch.Generator):
        self.generators = list(generators)

    def state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "torch": torch.get_rng_state(),
            "numpy": np.random.get_state(),
            "python": random.getstate(),
            "generators": [g.get_state() for g in self.generators],
        }
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            out["cuda"] = torch.cuda.get_rng_state_all()
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        gens = state.get("generators", [])
        if len(gens) != len(self.generators):
            raise ValueError(
                f"the checkpoint holds {len(gens)} torch.Generator states, this RNGState "
                f"has {len(self.generators)} generators"
            )
        torch.set_rng_state(state["torch"])
        np.random.set_state(tuple(state["numpy"]))
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
        for g, s in zip(self.generators, gens, strict=True):
            g.set_state(s)
        if "cuda" in state and torch.cuda.is_available():
            # One state per device visible at save time; set_rng_state_all indexes
            # torch.cuda.default_generators[i] for every one (IndexError past the devices
            # visible now, e.g. a resume with CUDA_VISIBLE_DEVICES=<local rank>).
            states = list(state["cuda"])[: torch.cuda.device_count()]
            torch.cuda.set_rng_state_all(states)

    def __repr__(self) -> str:
        return f"RNGState({len(self.generators)} generators)"
