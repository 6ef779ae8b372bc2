"""The scorer against an independent oracle: each request's log-likelihood equals a float64 forward of
the same tokens through the plain model (no cache, no batching), and `greedy` its argmax check."""

from __future__ import annotations

import pytest
import torch

from model import GPTConfig, build
from parallel.topology import Topology
from train.evaluation.requests import TokenRequest, fit
from train.evaluation.scorer import batch_cost, batch_work, batches, score_requests

V = 97


def config() -> GPTConfig:  # banded layers too: the cache keeps only a window of keys there
    return GPTConfig(name="eval", n_layer=3, n_head=2, d_model=32, seq_len=24, vocab_size=V,
                     attention_pattern="alternating", local_window=6)


def float64_score(model64, request: TokenRequest) -> tuple[float, bool]:
    """log p(continuation | context) and the all-argmax check from one float64 forward of context + continuation."""
    tokens = torch.tensor([request.context + request.continuation])  # (1, m + n)
    n = len(request.continuation)
    with torch.no_grad():
        logprobs = torch.log_softmax(model64(tokens[:, :-1])[0, -n:], dim=-1)  # (n, V)
    target = torch.tensor(request.continuation)
    return logprobs.gather(-1, target[:, None]).sum().item(), bool((logprobs.argmax(-1) == target).all())


def greedy_continuation(model64, context: tuple[int, ...], n: int) -> tuple[int, ...]:
    tokens = list(context)
    with torch.no_grad():
        for _ in range(n):
            tokens.append(int(model64(torch.tensor([tokens]))[0, -1].argmax()))
    return tuple(tokens[len(context):])


@pytest.fixture(scope="module")
def models():
    return build(config(), seed=5).eval(), build(config(), seed=5).double().eval()


def requests_with_shared_contexts(model64) -> list[TokenRequest]:
    """Multiple-choice items (one context, 3 endings), Winograd-like items (contexts sharing an
    ending), one-token contexts, a greedy continuation (its flag must be True), and a request cut
    from the left to the model's window."""
    g = torch.Generator().manual_seed(1)

    def draw(n):
        return tuple(torch.randint(0, V, (n,), generator=g).tolist())

    requests = []
    for m in (1, 5, 5, 9, 14):
        context = draw(m)
        requests += [TokenRequest(context, draw(n)) for n in (1, 3, 6)]
    ending = draw(4)
    requests += [TokenRequest(draw(7), ending) for _ in range(3)]
    context = draw(6)
    requests.append(TokenRequest(context, greedy_continuation(model64, context, 5)))
    requests.append(fit(draw(30), draw(3), config().seq_len)[0])
    return requests


@pytest.mark.parametrize("batch_tokens", [1, 40, 4096], ids=["one-group-per-batch", "several", "one-batch"])
def test_every_log_likelihood_equals_a_float64_forward_of_the_same_prompt(models, batch_tokens):
    model, model64 = models
    requests = requests_with_shared_contexts(model64)
    scores = score_requests(model, config(), Topology.create(1, 1), requests, batch_tokens)
    greedy = []
    for request, score in zip(requests, scores):
        expected, expected_greedy = float64_score(model64, request)
        assert score.logprob == pytest.approx(expected, rel=1e-5, abs=1e-5), request
        assert score.greedy == expected_greedy
        greedy.append(score.greedy)
    assert greedy[-2] and not all(greedy)  # the check has teeth both ways
    assert model.training is False


def test_the_model_goes_back_to_the_mode_it_was_in(models):
    model, _ = models
    model.train()
    score_requests(model, config(), Topology.create(1, 1), [TokenRequest((1, 2), (3,))], 64)
    assert model.training
    model.eval()


def test_batches_encode_each_context_once_and_keep_padding_and_repeated_tails_small(models):
    _, model64 = models
    requests = requests_with_shared_contexts(model64)
    planned = batches(requests, batch_tokens=64)
    contexts = [context for batch in planned for context, _ in batch]
    assert len(contexts) == len(set(contexts)) == len({r.context for r in requests})
    assert sorted(i for batch in planned for _, rows in batch for i in rows) == list(range(len(requests)))
    for batch in planned:
        if len(batch) > 1:
            assert batch_cost(batch, requests) <= min(64, 1.25 * batch_work(batch, requests))
    assert any(len({len(c) for c, _ in batch}) > 1 for batch in planned)  # nearby lengths do share a batch
    three_endings = [rows for batch in planned for _, rows in batch if len(rows) == 3]
    assert len(three_endings) == 5  # the multiple-choice items: one context, three rows each


def test_a_request_longer_than_the_window_keeps_its_last_seq_len_plus_one_tokens():
    context, continuation = tuple(range(30)), (40, 41, 42)
    request, cut = fit(context, continuation, seq_len=24)
    assert cut and request.continuation == continuation and request.context == tuple(range(8, 30))
    assert fit((1, 2), (3,), seq_len=24) == (TokenRequest((1, 2), (3,)), False)
    request, cut = fit((1,), tuple(range(2, 40)), seq_len=24)  # the continuation alone fills the window
    assert cut and request.continuation == tuple(range(16, 40)) and request.context == (15,)
