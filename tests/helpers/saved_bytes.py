"""What autograd keeps for backward, counted the way the planner counts activations."""

from __future__ import annotations

import torch


def saved_bytes(model, idx: torch.Tensor, targets: torch.Tensor) -> int:
    """Bytes of the distinct non-parameter storages autograd keeps for the backward of
    model(idx, targets): each saved tensor's whole storage, once however many views of it are saved.
    Under an autocast context of the caller's the forward runs in it."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(idx, targets)
    del loss  # the graph and everything it saved are freed; nothing needs the backward pass
    return sum(storages.values())
