"""Log-likelihoods of continuations, at any layout: the one scoring engine of every task and of lm-eval.

For a request (context c of m tokens, continuation x of n tokens) the score is

    log p(x | c) = Σ_{i<n} log softmax(z_i)[x_i],   z_i the logits after c x_0 … x_{i−1}

(in float32 from the model's logits, summed in float64), and `greedy` says whether every x_i is the
argmax of z_i (LAMBADA's accuracy: the whole word is the greedy continuation).

Batched so the device stays busy, and each context encoded once:
  1. requests are grouped by context; the endings of a multiple-choice item share one group;
  2. groups of equal context length form batches of at most `batch_tokens` input tokens, longest
     contexts first (no padding in the contexts, so every position is the one it would be alone);
  3. a batch runs c[:−1] of its G contexts once, (G, m − 1), into a KVCache (model/kv_cache.py); the
     cache rows are then repeated per continuation (KVCache.select) and the R continuations run as
     (R, n_max) rows [c_{m−1}, x_0 … x_{n−2}], right-padded (causal attention: padding after a token
     never reaches it); only the real positions go through the unembedding.

At any layout every rank runs this with the same requests: parallel.generate.LayoutDecoder carries
the activations stage to stage, gathers the vocabulary shards and shares the last stage's scores with
the other stages; data-parallel replicas take every dp-th batch and the results are all-gathered, so
every rank returns all scores. The batches do not depend on the layout, so neither do the numbers
(within float32 rounding of the sharded sums).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from model import GPTConfig
from model.kv_cache import KVCache
from train.evaluation.requests import TokenRequest

LOGIT_ELEMENTS = 1 << 26  # full-vocabulary logits held at once (256 MiB in float32)


@dataclass(frozen=True)
class Score:
    logprob: float  # log p(continuation | context)
    greedy: bool  # every continuation token is the argmax


def batches(requests: list[TokenRequest], batch_tokens: int) -> list[list[tuple[tuple[int, ...], list[int]]]]:
    """The batches of step 2: each a list of (context, indices of its requests), contexts of one length."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for index, request in enumerate(requests):
        groups.setdefault(request.context, []).append(index)
    out, cost = [], 0
    for context in sorted(groups, key=lambda c: (-len(c), c)):
        rows = groups[context]
        longest = max(len(requests[i].continuation) for i in rows)
        size = len(context) - 1 + len(rows) * longest
        if out and len(out[-1][0][0]) == len(context) and cost + size <= batch_tokens:
            out[-1].append((context, rows))
            cost += size
        else:
            out.append([(context, rows)])
            cost = size
    return out


@torch.no_grad()
def score_requests(part, config: GPTConfig, topology, requests: list[TokenRequest], batch_tokens: int,
                   bf16: bool = False) -> list[Score]:
    """The Score of every request, on every rank; `part` is this rank's part of the model
    (parallel.build), all ranks of the layout call this together (see the module docstring)."""
    from parallel.generate import LayoutDecoder

    decoder = LayoutDecoder(part, config, topology)
    was_training = part.training
    part.eval()
    found: dict[int, tuple[float, bool]] = {}
    device_type = decoder.device.type
    try:
        with torch.compiler.set_stance("force_eager"), torch.autocast(device_type, torch.bfloat16, enabled=bf16):
            for number, batch in enumerate(batches(requests, batch_tokens)):
                if number % topology.dp_size == topology.dp_rank:
                    found.update(_score_batch(decoder, batch, requests))
    finally:
        part.train(was_training)
    if topology.dp_size > 1:
        shares = [None] * topology.dp_size
        dist.all_gather_object(shares, found, group=topology.dp_group)
        found = {index: score for share in shares for index, score in share.items()}
    return [Score(*found[i]) for i in range(len(requests))]


def _score_batch(decoder, batch, requests: list[TokenRequest]) -> dict[int, tuple[float, bool]]:
    device = decoder.device
    contexts = [context for context, _ in batch]
    rows = [index for _, indices in batch for index in indices]
    cache = KVCache()
    if len(contexts[0]) > 1:  # step 3: the contexts but their last token, once each
        decoder.hidden_states(torch.tensor([c[:-1] for c in contexts], device=device), cache)  # (G, m − 1)
    group = torch.tensor([g for g, (_, indices) in enumerate(batch) for _ in indices], device=device)  # (R,)
    cache.select(group)
    width = max(len(requests[i].continuation) for i in rows)
    inputs = torch.zeros(len(rows), width, dtype=torch.long, device=device)  # (R, n_max)
    targets = torch.zeros_like(inputs)  # (R, n_max)
    for r, index in enumerate(rows):
        request = requests[index]
        n = len(request.continuation)
        inputs[r, :n] = torch.tensor(request.context[-1:] + request.continuation[:-1])
        targets[r, :n] = torch.tensor(request.continuation)
    real = torch.arange(width, device=device)[None, :] < torch.tensor(
        [len(requests[i].continuation) for i in rows], device=device)[:, None]  # (R, n_max)
    hidden = decoder.hidden_states(inputs, cache)  # (R, n_max, d) on the last stage
    sums = torch.zeros(len(rows), dtype=torch.float64, device=device)  # (R,)
    misses = torch.zeros(len(rows), dtype=torch.int64, device=device)  # (R,): tokens that are not the argmax
    if decoder.last:
        row_of = torch.arange(len(rows), device=device)[:, None].expand_as(real)[real]  # (N,)
        logprobs, hits = _token_scores(decoder, hidden[real], targets[real])  # (N,), (N,)
        sums.index_add_(0, row_of, logprobs.double())
        misses.index_add_(0, row_of, (~hits).long())
    sums, misses = decoder.from_last_stage(sums), decoder.from_last_stage(misses)
    return {index: (sums[r].item(), misses[r].item() == 0) for r, index in enumerate(rows)}


def _token_scores(decoder, hidden: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """log softmax(z)[target] and argmax(z) == target for hidden states (N, d) and targets (N,), a
    chunk of positions at a time so that (chunk, V) float32 logits stay under LOGIT_ELEMENTS."""
    chunk = max(1, LOGIT_ELEMENTS // decoder.config.vocab_size)
    logprobs, hits = [], []
    for start in range(0, hidden.shape[0], chunk):
        logits = decoder.full_logits(hidden[None, start : start + chunk])[0].float()  # (c, V)
        target = targets[start : start + chunk, None]  # (c, 1)
        logprobs.append(torch.log_softmax(logits, dim=-1).gather(-1, target)[:, 0])  # (c,)
        hits.append(logits.argmax(dim=-1) == target[:, 0])  # (c,)
    return torch.cat(logprobs), torch.cat(hits)
