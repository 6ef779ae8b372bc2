"""Log-likelihoods of continuations, at any layout: the one scoring engine of every task and of lm-eval.

For a request (context c of m tokens, continuation x of n tokens) the score is

    log p(x | c) = Σ_{i<n} log softmax(z_i)[x_i],   z_i the logits after c x_0 … x_{i−1}

(in float32 from the model's logits, summed in float64), and `greedy` says whether every x_i is the
argmax of z_i (LAMBADA's accuracy: the whole word is the greedy continuation).

Batched so the device stays busy, and each context encoded once:
  1. requests are grouped by context; the endings of a multiple-choice item share one group;
  2. groups, longest context first, form batches; a batch of G contexts of lengths m_g shares a prefix
     length P = min_g m_g − 1;
  3. a batch runs the first P tokens of each of its contexts once, (G, P), into a KVCache
     (model/kv_cache.py); the cache rows are then repeated per continuation (KVCache.select) and the
     R continuations run as (R, width) rows [c_P … c_{m−1}, x_0 … x_{n−2}], right-padded (causal
     attention: padding after a token never reaches it), every row's tokens at their own positions
     P, P + 1, …; only the positions that predict a continuation token go through the unembedding.
  The cost of a batch is G·P + R·width input tokens, padding included; a group joins the batch while
  the cost stays within `batch_tokens` and within 1.25 × the batch's tokens without padding or
  repeated context tails (Σ_g (m_g − 1) + Σ_r n_r), so contexts of nearby lengths share a batch and
  far ones do not. Each token is at the position it would have alone, so the result is the same
  function of the request whatever its batch (up to float rounding).

At any layout every rank runs this with the same requests: parallel.layout_decoder.LayoutDecoder carries
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


Batch = list[tuple[tuple[int, ...], list[int]]]  # (context, indices of its requests) per group


def batches(requests: list[TokenRequest], batch_tokens: int) -> list[Batch]:
    """The batches of steps 1 and 2 (see the module docstring)."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for index, request in enumerate(requests):
        groups.setdefault(request.context, []).append(index)
    out: list[Batch] = []
    for context in sorted(groups, key=lambda c: (-len(c), c)):
        group = (context, groups[context])
        if out and batch_cost(out[-1] + [group], requests) <= min(batch_tokens, 1.25 * batch_work(out[-1] + [group], requests)):
            out[-1].append(group)
        else:
            out.append([group])
    return out


def _prefix(batch: Batch) -> int:
    """P: the context tokens every context of the batch has before the ones its rows run themselves."""
    return min(len(context) for context, _ in batch) - 1


def batch_cost(batch: Batch, requests: list[TokenRequest]) -> int:
    """Input tokens the batch runs, padding included: G·P + R·width."""
    prefix = _prefix(batch)
    width = max(len(context) - prefix + len(requests[i].continuation) - 1 for context, rows in batch for i in rows)
    return len(batch) * prefix + sum(len(rows) for _, rows in batch) * width


def batch_work(batch: Batch, requests: list[TokenRequest]) -> int:
    """Input tokens without padding or repeated context tails: Σ_g (m_g − 1) + Σ_r n_r."""
    return sum(len(context) - 1 + sum(len(requests[i].continuation) for i in rows) for context, rows in batch)


@torch.no_grad()
def score_requests(part, config: GPTConfig, topology, requests: list[TokenRequest], batch_tokens: int,
                   bf16: bool = False) -> list[Score]:
    """The Score of every request, on every rank; `part` is this rank's part of the model
    (parallel.build), all ranks of the layout call this together (see the module docstring)."""
    from parallel.layout_decoder import LayoutDecoder

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


def _score_batch(decoder, batch: Batch, requests: list[TokenRequest]) -> dict[int, tuple[float, bool]]:
    device = decoder.device
    prefix = _prefix(batch)
    rows = [(context, index) for context, indices in batch for index in indices]
    cache = KVCache()
    if prefix:  # step 3: the shared part of the contexts, once each
        decoder.hidden_states(torch.tensor([c[:prefix] for c, _ in batch], device=device), cache)  # (G, P)
    cache.select(torch.tensor([g for g, (_, indices) in enumerate(batch) for _ in indices], device=device))  # (R,)
    tails = [context[prefix:] + requests[index].continuation[:-1] for context, index in rows]
    width = max(len(tail) for tail in tails)
    inputs = torch.zeros(len(rows), width, dtype=torch.long, device=device)  # (R, width)
    targets = torch.zeros_like(inputs)  # (R, width): the token each position predicts
    scored = torch.zeros(len(rows), width, dtype=torch.bool, device=device)  # (R, width): it predicts a continuation token
    for r, ((context, index), tail) in enumerate(zip(rows, tails)):
        continuation = requests[index].continuation
        inputs[r, : len(tail)] = torch.tensor(tail)
        targets[r, len(tail) - len(continuation) : len(tail)] = torch.tensor(continuation)
        scored[r, len(tail) - len(continuation) : len(tail)] = True
    hidden = decoder.hidden_states(inputs, cache)  # (R, width, d) on the last stage
    sums = torch.zeros(len(rows), dtype=torch.float64, device=device)  # (R,)
    misses = torch.zeros(len(rows), dtype=torch.int64, device=device)  # (R,): tokens that are not the argmax
    if decoder.last:
        row_of = torch.arange(len(rows), device=device)[:, None].expand_as(scored)[scored]  # (N,)
        logprobs, hits = _token_scores(decoder, hidden[scored], targets[scored])  # (N,), (N,)
        sums.index_add_(0, row_of, logprobs.double())
        misses.index_add_(0, row_of, (~hits).long())
    sums, misses = decoder.from_last_stage(sums), decoder.from_last_stage(misses)
    return {index: (sums[r].item(), misses[r].item() == 0) for r, (_, index) in enumerate(rows)}


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
