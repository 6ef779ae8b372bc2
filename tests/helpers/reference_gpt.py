"""An independent GPT-2 forward pass on full, unpadded tensors, for the padded and fused models to equal.

    loss = reference_loss(full, config, idx, targets)

`full` maps parallel.naming's full names ("layers.0.wte.weight" (V, d), "layers.1.attn.qkv.weight", …)
to tensors; nothing here pads the vocabulary or shares code with model/. Differentiate with
torch.autograd.grad over the tensors of `full` (make them leaves with requires_grad first).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def reference_logits(full: dict[str, torch.Tensor], config, idx: torch.Tensor) -> torch.Tensor:
    """Logits (B, T, V) of the dense GPT-2 architecture (pre-LayerNorm, tanh-GELU, tied unembedding)."""
    b, t = idx.shape
    d, n_head, eps = config.d_model, config.n_head, config.ln_eps
    wte = full["layers.0.wte.weight"]  # (V, d)
    h = wte[idx] + full["layers.0.wpe.weight"][:t]  # (B, T, d)
    causal = torch.triu(torch.ones(t, t, dtype=torch.bool), 1)
    for i in range(1, config.n_layer + 1):
        p = {name.removeprefix(f"layers.{i}."): v for name, v in full.items() if name.startswith(f"layers.{i}.")}
        x = F.layer_norm(h, (d,), p["ln_1.weight"], p["ln_1.bias"], eps)
        qkv = (x @ p["attn.qkv.weight"].T + p["attn.qkv.bias"]).view(b, t, n_head, 3, d // n_head)
        q, k, v = (qkv[:, :, :, j].transpose(1, 2) for j in range(3))  # each (B, H, T, hd)
        s = (q @ k.transpose(-1, -2) / (d // n_head) ** 0.5).masked_fill(causal, float("-inf"))
        y = (s.softmax(-1) @ v).transpose(1, 2).reshape(b, t, d)
        h = h + y @ p["attn.proj.weight"].T + p["attn.proj.bias"]
        x = F.layer_norm(h, (d,), p["ln_2.weight"], p["ln_2.bias"], eps)
        m = F.gelu(x @ p["mlp.fc.weight"].T + p["mlp.fc.bias"], approximate="tanh")
        h = h + m @ p["mlp.proj.weight"].T + p["mlp.proj.bias"]
    last = config.n_layer + 1
    h = F.layer_norm(h, (d,), full[f"layers.{last}.ln_f.weight"], full[f"layers.{last}.ln_f.bias"], eps)
    return h @ wte.T  # (B, T, V)


def reference_loss(full: dict[str, torch.Tensor], config, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of reference_logits (targets == -100 left out)."""
    logits = reference_logits(full, config, idx)
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)


def reference_loss_and_grads(full: dict[str, torch.Tensor], config, idx, targets) -> tuple[float, dict[str, torch.Tensor]]:
    """(loss, {name: ∂loss/∂tensor}) in float64."""
    leaves = {name: t.detach().double().requires_grad_() for name, t in full.items()}
    loss = reference_loss(leaves, config, idx, targets)
    grads = torch.autograd.grad(loss, list(leaves.values()))
    return loss.item(), dict(zip(leaves, grads))


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """‖got − want‖ / ‖want‖ (max-norm), in float64."""
    got, want = got.double(), want.double()
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()
