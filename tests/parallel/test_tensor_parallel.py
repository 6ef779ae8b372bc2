"""Tensor parallelism reproduces the one-process model (invariant 1, layout invariance).

Each distributed case spawns tp gloo processes once and measures everything there (weights
after init, logits, loss, every gradient, a 3-step AdamW loss curve, the collectives of one
step; with and without sequence parallelism); the tests below compare those measurements with
the same procedure run on the plain one-process model built from the same seed.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from torch import nn

from model import GPT, GPTConfig, build, generate
from model.init import init_layer_, materialize_
from model.layers import Block, Embedding
from parallel.comm import record_comm
from parallel.tensor import (
    ColumnParallelLinear,
    FullLogits,
    RowParallelLinear,
    VocabParallelEmbedding,
    gather_logits,
    padded_vocab_size,
    shard,
    shard_layer,
    tied_unembedding,
    vocab_parallel_cross_entropy,
    vocab_parallel_loss,
)
from parallel.topology import Topology, check_layout
from distributed import run_distributed

# vocab 300 is no multiple of 128·tp: at tp=2 the shards are [0, 256) and [256, 512) with 212
# padded rows, at tp=4 the last shard is padding only.
CONFIG = GPTConfig(name="tp-test", n_layer=2, n_head=4, d_model=32, seq_len=16, vocab_size=300)
SEED, BATCH, STEPS, LR = 1234, 2, 3, 1e-2
TOL = 1e-5
F32 = 4  # bytes


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    """(idx, targets), (BATCH, seq_len) each, with ids from every vocabulary shard."""
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, CONFIG.vocab_size, (BATCH, CONFIG.seq_len + 1), generator=generator)
    tokens[0, :5] = torch.tensor([0, 299, 256, 255, 128])
    return tokens[:, :-1], tokens[:, 1:]


def measure(model: GPT, full_logits, full_tensor, grad_norm) -> dict:
    """The procedure both sides run. full_logits(idx) gives (B, T, V); full_tensor(p, t) turns a
    parameter-shaped local tensor (the parameter or its gradient) into the unsharded one;
    grad_norm(parameters) is the global gradient 2-norm."""
    params = {n: full_tensor(p, p.detach()) for n, p in model.named_parameters()}
    with torch.no_grad():
        logits = full_logits(batch()[0])
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, grads, events, norm = [], {}, [], None
    for step in range(STEPS):
        with record_comm() as recorded:
            loss = model(*batch())  # the same batch: the loss falls
            loss.backward()
        if step == 0:
            grads = {n: full_tensor(p, p.grad) for n, p in model.named_parameters()}
            norm = float(grad_norm(list(model.parameters())))
            events = recorded
        losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad()
    return {"params": params, "logits": logits, "grads": grads, "grad_norm": norm, "losses": losses, "events": events}


def greedy(model) -> torch.Tensor:
    """8 greedily generated tokens after the first 4 of the batch."""
    return generate(model, batch()[0][:, :4], max_new_tokens=8, temperature=0)


def _gather_shards(param: torch.nn.Parameter, local: torch.Tensor, group) -> torch.Tensor:
    """Unshard along the dimension where the local shape differs from full_shape (plain all_gather;
    group None: one process, where only the vocabulary's padding rows are cut off)."""
    full_shape = getattr(param, "full_shape", tuple(param.shape))
    differing = [d for d in range(local.dim()) if local.shape[d] != full_shape[d]]
    if not differing:
        return local.clone()
    dim = differing[0]
    pieces = [local.clone()]
    if group is not None:
        pieces = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(pieces, local.contiguous(), group=group)
    return torch.cat(pieces, dim=dim).narrow(dim, 0, full_shape[dim])


def _layout_of(topology: Topology) -> dict:
    ranks = dist.get_process_group_ranks
    return {
        "coords": (topology.rank, topology.pp_rank, topology.dp_rank, topology.tp_rank),
        "sizes": (topology.pp_size, topology.dp_size, topology.tp_size),
        "groups": tuple(ranks(g) for g in (topology.pp_group, topology.dp_group, topology.tp_group)),
        "model_parallel": ranks(topology.model_parallel_group),
        "mpu_tp": (topology.mpu.get_tensor_model_parallel_rank(), topology.mpu.get_tensor_model_parallel_world_size()),
    }


def _cross_entropy_case(group) -> dict:
    """Vocab-parallel CE on shards of fixed full logits whose padded columns hold large junk."""
    gen = torch.Generator().manual_seed(7)
    n, vocab, tp = 37, CONFIG.vocab_size, dist.get_world_size(group)
    logits = 3 * torch.randn(n, vocab, generator=gen)
    targets = torch.randint(0, vocab, (n,), generator=gen)
    targets[:4] = torch.tensor([0, vocab - 1, 256, -100])
    junk = torch.full((n, padded_vocab_size(vocab, tp) - vocab), 100.0)
    local = torch.cat([logits, junk], dim=1).chunk(tp, dim=1)[dist.get_rank(group)].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(local.unsqueeze(0), targets.unsqueeze(0), group, vocab)
    loss.backward()
    pieces = [torch.empty_like(local) for _ in range(tp)]
    dist.all_gather(pieces, local.grad, group=group)
    return {"logits": logits, "targets": targets, "loss": loss.detach(), "grad": torch.cat(pieces, dim=1)}


def _meta_case(topology: Topology) -> dict:
    """Shard a meta model: owner module, shape, device and mark of each parameter; errors of bad plans."""
    with torch.device("meta"):
        model = shard(GPT(CONFIG), topology)
    params = {}
    for name, p in model.named_parameters():
        owner = type(model.get_submodule(name.rpartition(".")[0])).__name__
        params[name] = (owner, tuple(p.shape), p.device.type, getattr(p, "model_parallel", False))
    errors, swapped = [], []
    for plan in ({"attn.qkvx": "column", "attn.qkv": "column"}, {"ln_1": "column"}, {"attn.qkv": "diagonal"}):
        with torch.device("meta"):
            bad = GPT(CONFIG)
        try:
            shard(bad, topology, plan=plan)
        except (ValueError, TypeError) as error:
            errors.append(str(error))
        swapped += [name for name, m in bad.named_modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]
    tied = model.head.lm_head.weight is model.embedding.wte.weight
    return {"params": params, "tied": tied, "errors": errors, "swapped_by_bad_plans": swapped}


def layerwise(topology: Topology) -> dict:
    """Build the model layer by layer, as a pipeline stage does (shard_layer, then allocate and draw
    each layer; tied_unembedding; vocab_parallel_loss): logits, loss and the tied matrix's gradient."""
    with torch.device("meta"):
        embedding, final = Embedding(CONFIG), nn.Module()
        blocks = [Block(CONFIG, i) for i in range(CONFIG.n_layer)]
        final.ln_f = nn.LayerNorm(CONFIG.d_model, eps=CONFIG.ln_eps)  # named as in the Head
    for index, layer in enumerate([embedding, *blocks, final]):
        shard_layer(layer, topology)
        materialize_(layer, "cpu")
        init_layer_(layer, index, SEED, CONFIG.n_layer, CONFIG.init_std)
    unembedding = tied_unembedding(embedding.wte, CONFIG.vocab_size, topology)
    idx, targets = batch()
    x = embedding(idx)
    for block in blocks:
        x = block(x)
    logits = unembedding(final.ln_f(x))  # (B, T, V) or (B, T, Vp/tp)
    loss_fn = vocab_parallel_loss(CONFIG.vocab_size, topology) if topology.tp_size > 1 else F.cross_entropy
    loss = loss_fn(logits.flatten(0, 1), targets.flatten())
    loss.backward()
    if topology.tp_size > 1:
        logits = gather_logits(logits, topology.tp_group, CONFIG.vocab_size)
    wte_grad = _gather_shards(embedding.wte.weight, embedding.wte.weight.grad, topology.tp_group)
    return {"logits": logits.detach(), "loss": loss.item(), "wte_grad": wte_grad}


def tp_worker(tp: int) -> dict:
    """One rank of a tp-way run (world size tp): all measurements, see the module docstring."""
    from deepspeed.runtime.utils import clip_grad_norm_

    topology = Topology.create(tp=tp)
    group = topology.tp_group
    result = {"layout": _layout_of(topology), "cross_entropy": _cross_entropy_case(group)}
    for sequence_parallel in (False, True):
        with torch.device("meta"):
            model = GPT(CONFIG)
        shard(model, topology, sequence_parallel=sequence_parallel).materialize("cpu", SEED)
        if not sequence_parallel:  # (sequence parallelism needs prompts of a multiple of tp tokens)
            result["generated"] = greedy(FullLogits(model))
        result[sequence_parallel] = measure(
            model,
            FullLogits(model),
            lambda p, t: _gather_shards(p, t, group),
            lambda params: clip_grad_norm_(params, max_norm=1e9, mpu=topology.mpu),  # reads model_parallel
        )
    result["meta"] = _meta_case(topology)
    result["layerwise"] = layerwise(topology)
    materialised = shard(build(CONFIG, "cpu", SEED), topology)
    result["from_materialised"] = {n: _gather_shards(p, p.detach(), group) for n, p in materialised.named_parameters()}
    if tp == 4:
        result["layouts"] = {(t, p): _layout_of(Topology.create(tp=t, pp=p)) for t, p in ((2, 1), (2, 2), (1, 2))}
    return result


@pytest.fixture(scope="module")
def reference() -> dict:
    model = build(CONFIG, "cpu", SEED)
    generated = greedy(model)
    return {"generated": generated} | measure(
        model,
        model,
        lambda p, t: _gather_shards(p, t, None),
        lambda params: torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params])),
    )


@pytest.fixture(scope="module", params=[2, 4], ids=lambda tp: f"tp{tp}")
def tp_run(request) -> tuple[int, list[dict]]:
    return request.param, run_distributed(tp_worker, request.param, request.param)


def assert_rel_close(actual: torch.Tensor, expected: torch.Tensor, what: str, tol: float = TOL) -> None:
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} ≠ {tuple(expected.shape)}"
    error = (actual - expected).abs().max().item() / max(expected.abs().max().item(), 1e-30)
    assert error <= tol, f"{what}: relative error {error:.2e} > {tol:.0e}"


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
def test_weights_logits_and_gradients_match_one_process(tp_run, reference, sequence_parallel):
    tp, ranks = tp_run
    for rank, result in enumerate(ranks):
        measured, where = result[sequence_parallel], f"tp={tp} sp={sequence_parallel} rank {rank}"
        assert measured["params"].keys() == reference["params"].keys()
        for name, expected in reference["params"].items():
            assert torch.equal(measured["params"][name], expected), f"{where}: initial {name} differs"
        assert_rel_close(measured["logits"], reference["logits"], f"{where}: logits")
        for name, expected in reference["grads"].items():
            assert_rel_close(measured["grads"][name], expected, f"{where}: grad of {name}")


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
def test_deepspeed_grad_norm_counts_every_shard_once(tp_run, reference, sequence_parallel):
    """DeepSpeed sums squared norms over the tp group: sharded (model_parallel) parameters on every
    rank, replicated ones on tp rank 0 only; the result is the one-process model's norm."""
    tp, ranks = tp_run
    for rank, result in enumerate(ranks):
        measured, expected = torch.tensor(result[sequence_parallel]["grad_norm"]), torch.tensor(reference["grad_norm"])
        assert_rel_close(measured, expected, f"tp={tp} sp={sequence_parallel} rank {rank}: grad norm")


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
def test_loss_curve_matches_one_process(tp_run, reference, sequence_parallel):
    tp, ranks = tp_run
    for rank, result in enumerate(ranks):
        curve, expected = torch.tensor(result[sequence_parallel]["losses"]), torch.tensor(reference["losses"])
        assert_rel_close(curve, expected, f"tp={tp} sp={sequence_parallel} rank {rank}: losses")
    assert reference["losses"][-1] < reference["losses"][0] - 0.05  # the curve moves: the check has teeth


def test_generation_matches_one_process(tp_run, reference):
    tp, ranks = tp_run
    for rank, result in enumerate(ranks):
        assert torch.equal(result["generated"], reference["generated"]), f"tp={tp} rank {rank}"


def test_layer_by_layer_build_matches_one_process(tp_run, reference):
    """The pieces a pipeline stage is built from give the one-process logits, loss and tied gradient."""
    tp, ranks = tp_run
    for rank, result in enumerate(ranks):
        check_layerwise(result["layerwise"], reference, f"tp={tp} rank {rank}")


def check_layerwise(measured: dict, reference: dict, where: str) -> None:
    assert_rel_close(measured["logits"], reference["logits"], f"{where}: logits")
    assert_rel_close(torch.tensor(measured["loss"]), torch.tensor(reference["losses"][0]), f"{where}: loss")
    expected = reference["grads"]["layers.0.wte.weight"]
    assert_rel_close(measured["wte_grad"], expected, f"{where}: grad of the tied matrix")


def test_vocab_parallel_cross_entropy_equals_full(tp_run):
    tp, ranks = tp_run
    case = ranks[0]["cross_entropy"]
    logits = case["logits"].clone().requires_grad_()
    expected = F.cross_entropy(logits, case["targets"])  # ignore_index=-100, as the parallel one
    expected.backward()
    for rank, result in enumerate(ranks):
        measured = result["cross_entropy"]
        assert_rel_close(measured["loss"], expected.detach(), f"tp={tp} rank {rank}: loss", tol=1e-6)
        assert_rel_close(measured["grad"][:, : CONFIG.vocab_size], logits.grad, f"tp={tp} rank {rank}: grad", tol=1e-6)
        assert not measured["grad"][:, CONFIG.vocab_size :].any(), "padded columns got gradient"


def test_block_all_reduces_match_megatron(tp_run):
    """Per block and step: 2 all-reduces of B·T·d forward (attn.proj, mlp.proj), 2 backward
    (input gradients of attn.qkv, mlp.fc). Outside the blocks: the embedding's all-reduce
    (forward), the unembedding's input gradient (backward) and the loss's 3 all-reduces of B·T."""
    tp, ranks = tp_run
    activation = BATCH * CONFIG.seq_len * CONFIG.d_model * F32
    for events in (result[False]["events"] for result in ranks):
        assert {e.op for e in events} == {"all_reduce"}
        for layer in range(1, CONFIG.n_layer + 1):
            for phase in ("forward", "backward"):
                sizes = [e.nbytes for e in events if e.tag.startswith(f"layers.{layer}.") and e.phase == phase]
                assert sizes == [activation, activation], f"tp={tp} layer {layer} {phase}: {sizes}"
        blocks = tuple(f"layers.{i}." for i in range(1, CONFIG.n_layer + 1))
        outside = sorted((e.tag, e.phase, e.nbytes) for e in events if not e.tag.startswith(blocks))
        tokens = BATCH * CONFIG.seq_len * F32
        assert outside == sorted(
            [("layers.0.wte", "forward", activation), (f"layers.{CONFIG.n_layer + 1}.lm_head", "backward", activation)]
            + [("loss", "forward", tokens)] * 3
        )


def test_sequence_parallel_communicates_like_megatron(tp_run):
    """With sequence parallelism each block all-gathers twice and reduce-scatters twice per pass, on
    B·T·d elements each (each pair sends, on a ring, what one all-reduce of the non-sequence-parallel
    layout sends), plus in backward one all-reduce of d per LayerNorm γ/β and row-parallel bias (6)."""
    tp, ranks = tp_run
    activation = BATCH * CONFIG.seq_len * CONFIG.d_model * F32
    for events in (result[True]["events"] for result in ranks):
        for layer in range(1, CONFIG.n_layer + 1):
            mine = [e for e in events if e.tag.startswith(f"layers.{layer}.")]
            big = sorted((e.phase, e.op) for e in mine if e.nbytes == activation)
            small = [e for e in mine if e.nbytes != activation]
            passes = [(p, op) for p in ("forward", "backward") for op in ("all_gather", "reduce_scatter")]
            assert big == sorted(passes * 2), f"tp={tp} layer {layer}: {big}"
            small = [(e.op, e.phase, e.nbytes) for e in small]
            assert small == [("all_reduce", "backward", CONFIG.d_model * F32)] * 6, f"tp={tp} layer {layer}: {small}"


def test_topology_puts_tensor_parallel_ranks_innermost(tp_run):
    tp, ranks = tp_run
    layouts = {(tp, 1): [r["layout"] for r in ranks]}
    if tp == 4:
        layouts.update({key: [r["layouts"][key] for r in ranks] for key in ranks[0]["layouts"]})
    for (t, p), per_rank in layouts.items():
        d = len(ranks) // (t * p)
        for rank, layout in enumerate(per_rank):
            pp, dp, tp_rank = rank // (d * t), rank // t % d, rank % t
            assert layout["coords"] == (rank, pp, dp, tp_rank)
            assert layout["sizes"] == (p, d, t)
            pp_group = [(q * d + dp) * t + tp_rank for q in range(p)]
            dp_group = [(pp * d + q) * t + tp_rank for q in range(d)]
            tp_group = [(pp * d + dp) * t + q for q in range(t)]
            assert layout["groups"] == (pp_group, dp_group, tp_group), f"tp={t} pp={p} rank {rank}"
            assert layout["model_parallel"] == [(q * d + dp) * t + r for q in range(p) for r in range(t)]
            assert layout["mpu_tp"] == (tp_rank, t)


def test_one_process_layout_leaves_the_model_alone():
    """tp = pp = 1 works with or without torch.distributed (another test may have started a group)."""
    topology = Topology.create()
    assert (topology.tp_size, topology.pp_size, topology.dp_size, topology.tp_rank) == (1, 1, 1, 0)
    if not dist.is_initialized():
        assert topology.mpu is None and topology.tp_group is None
    model = build(CONFIG, "cpu", SEED)
    before = dict(model.named_parameters())
    assert shard(model, topology) is model
    assert dict(model.named_parameters()) == before
    with pytest.raises(ValueError, match=r"world size 1 is not a multiple of tp·pp = 2 \(parallel.tp=2, "):
        Topology.create(tp=2)


def test_one_process_layer_by_layer_build_matches(reference):
    check_layerwise(layerwise(Topology.create()), reference, "tp=1")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(tp=3), r"parallel.tp=3 does not divide model.n_head=16; valid tp: 1, 2, 4, 8, 16"),
        (dict(tp=3), r"parallel.tp=3 does not divide model.d_ff=4096"),
        (dict(pp=25), r"parallel.pp=25 exceeds model.n_layer=24"),
        (dict(tp=4, pp=2, world_size=12), r"12 is not a multiple of tp·pp = 8 \(.*: 1, 2, 3, 4, 6, 12$"),
        (dict(tp=2, dp=3, world_size=8), r"8 ≠ tp·pp·dp = 6 \(parallel.tp=2, parallel.pp=1, parallel.dp=3\).* 4$"),
        (dict(tp=0), r"parallel.tp=0: must be a positive integer"),
    ],
    ids=["heads", "d_ff", "pp", "world", "dp", "positive"],
)
def test_check_layout_names_the_problem_and_what_fits(kwargs, message):
    args = dict(n_head=16, d_ff=4096, tp=1, pp=1, n_layer=24, world_size=kwargs.get("tp", 1) * kwargs.get("pp", 1))
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        check_layout(**args)


def test_check_layout_returns_data_parallel_size():
    assert check_layout(n_head=96, d_ff=49152, tp=8, pp=16, n_layer=96, world_size=1024) == 8
    assert check_layout(n_head=16, d_ff=4096, tp=2, pp=2, n_layer=24, world_size=8, dp=2) == 2


def test_plan_swaps_modules_on_meta_and_marks_shards(tp_run):
    tp, ranks = tp_run
    d, d_ff, vocab_rows = CONFIG.d_model, CONFIG.d_ff, padded_vocab_size(CONFIG.vocab_size, tp) // tp
    sharded = {  # parameter name suffix → (owner, local shape, marked model_parallel)
        "wte.weight": (VocabParallelEmbedding, (vocab_rows, d), True),
        "attn.qkv.weight": (ColumnParallelLinear, (3 * d // tp, d), True),
        "attn.qkv.bias": (ColumnParallelLinear, (3 * d // tp,), True),
        "attn.proj.weight": (RowParallelLinear, (d, d // tp), True),
        "attn.proj.bias": (RowParallelLinear, (d,), False),
        "mlp.fc.weight": (ColumnParallelLinear, (d_ff // tp, d), True),
        "mlp.fc.bias": (ColumnParallelLinear, (d_ff // tp,), True),
        "mlp.proj.weight": (RowParallelLinear, (d, d_ff // tp), True),
        "mlp.proj.bias": (RowParallelLinear, (d,), False),
    }
    for name, (owner, shape, device, marked) in ranks[0]["meta"]["params"].items():
        suffix = next((s for s in sharded if name.endswith(s)), None)
        expected = sharded[suffix] if suffix else ("LayerNorm" if "ln_" in name else "Embedding", shape, False)
        expected_owner = expected[0] if isinstance(expected[0], str) else expected[0].__name__
        assert (owner, shape, device, marked) == (expected_owner, expected[1], "meta", expected[2]), name
    assert ranks[0]["meta"]["tied"], "lm_head is not tied to the vocab-parallel embedding"
    assert ranks[0]["meta"]["errors"] == [
        "plan keys ['attn.qkvx'] match no module of the model",
        "plan maps 'layers.1.ln_1' (LayerNorm) to 'column', which needs <class 'model.recompute.Linear'>",
        "plan maps 'layers.1.attn.qkv' to 'diagonal'; styles are ['column', 'row', 'sequence', 'vocab']",
    ]
    assert ranks[0]["meta"]["swapped_by_bad_plans"] == [], "a rejected plan changed the model"


def test_sharding_a_materialised_model_keeps_its_values(tp_run, reference):
    tp, ranks = tp_run
    for rank, result in enumerate(ranks):
        for name, expected in reference["params"].items():
            assert torch.equal(result["from_materialised"][name], expected), f"tp={tp} rank {rank}: {name}"
