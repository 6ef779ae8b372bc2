"""A process's random number generators as a checkpoint part: torch's (and CUDA's) state as base64
bytes, Python's as numbers. Each rank saves its own (rng.json) and a resume at the same layout takes
its rank's back."""

from __future__ import annotations

import base64
import random

import torch


class ProcessRNG:
    """This process's RNG states, registered as a per-rank part."""

    def state_dict(self) -> dict:
        version, internal, gauss = random.getstate()
        state = {"torch": _b64(torch.get_rng_state()), "python": [version, list(internal), gauss]}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = _b64(torch.cuda.get_rng_state())
        return state

    def load_state_dict(self, state: dict) -> None:
        torch.set_rng_state(_unb64(state["torch"]))
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state(_unb64(state["cuda"]))


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode("ascii")


def _unb64(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)
