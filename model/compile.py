"""model.compile: each transformer Block through torch.compile, or eager where that cannot work.

Each Block is compiled on its own (nn.Module.compile: the module, its parameters and their names
stay as they are, so checkpoints, naming and pipeline stages do not notice). The attention inside
is one opaque custom op with its own backward (model/attention_op.py); LayerNorms, bias adds,
GELU and the residual adds around it are what the compiler fuses. The embedding, the head and the
loss stay eager (the fused loss, model/fused_loss.py, already avoids the full logits).

Whether compilation works here is asked once per build with a probe (a two-op function compiled
and run on the model's device): without a C++ compiler for CPU inductor, without
Triton for GPU inductor, or on a Python torch.compile does not support, the probe fails and the
blocks stay eager, with one warning naming why. Generation runs eager (model/decoding.py):
decoding one token at a time against a growing cache would recompile for every length.
"""

from __future__ import annotations

import warnings
from typing import Iterable

import torch
from torch import nn

from model.layers import Block


def compile_unavailable(device: torch.device | str) -> str | None:
    """None when torch.compile compiles and runs a small function on `device`; else why not, in one line."""
    try:
        torch.compile(lambda t: t.sin() * 2.0, fullgraph=True)(torch.ones(8, device=device))
    except Exception as error:  # any failure of the toolchain means: run eager
        reason = str(error).strip().splitlines()
        return f"{type(error).__name__}: {reason[0] if reason else ''}"[:300]
    return None


def compile_blocks(layers: Iterable[nn.Module], device: torch.device | str) -> bool:
    """Compile every Block among `layers` in place; True if compiled, False (with one warning) if
    torch.compile is unavailable on `device`."""
    blocks = [layer for layer in layers if isinstance(layer, Block)]
    if not blocks:
        return False
    reason = compile_unavailable(device)
    if reason is not None:
        warnings.warn(f"model.compile=true: torch.compile is unavailable on {device} ({reason}); the blocks run eager",
                      stacklevel=2)
        return False
    for block in blocks:
        block.compile()
    return True
