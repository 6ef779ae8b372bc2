"""Text from the model a run holds, at its layout: the end-of-training sample and `python -m train.generate`."""

from __future__ import annotations

import torch

from model import GPTConfig, generate
from train.data.tokenizer import EOT, gpt2


@torch.no_grad()
def sample_text(part, config: GPTConfig, topology, prompt: str, max_new_tokens: int, device, seed: int,
                temperature: float = 0.8, top_k: int | None = 50, bf16: bool = False) -> tuple[str, list[int]]:
    """Continue `prompt` with this rank's part of the model (parallel.build); every rank of the
    layout calls it and gets the same (text, token ids). Equal seeds give equal samples. bf16: the
    matrix products in bf16 (torch autocast), as a run in any precision but fp32 computes them
    (train.precision=auto on a GPU; forced on the CPU by train.precision=bf16)."""
    from parallel.layout_decoder import LayoutDecoder

    encoder = gpt2()
    idx = torch.tensor([encoder.encode_ordinary(prompt) or [EOT]], device=device)  # (1, T0); "" starts a document
    generator = torch.Generator(device=device).manual_seed(seed)
    was_training = part.training
    part.eval()
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
        out = generate(LayoutDecoder(part, config, topology), idx, max_new_tokens, temperature, top_k, generator)
    part.train(was_training)
    tokens = out[0].tolist()
    return encoder.decode(tokens), tokens
