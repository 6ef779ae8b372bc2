"""The model family: GPT-3 shapes and sizes, meta construction, init, tying, overfitting one batch."""

from pathlib import Path

import pytest
import torch
import yaml

from model import GPT, GPTConfig, build, count_parameters
from model.modes import LayerModes

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs" / "model"

# Brown et al. 2020, Table 2.1: (parameters, layers, d_model, heads, d_head). For 1.3B the paper prints
# 24 heads and for 13B d_model 5140; both contradict its d_head (see DESIGN.md), so heads/d_model follow d_head.
PAPER = {
    "gpt3-125m": (125e6, 12, 768, 12, 64),
    "gpt3-350m": (350e6, 24, 1024, 16, 64),
    "gpt3-760m": (760e6, 24, 1536, 16, 96),
    "gpt3-1.3b": (1.3e9, 24, 2048, 16, 128),
    "gpt3-2.7b": (2.7e9, 32, 2560, 32, 80),
    "gpt3-6.7b": (6.7e9, 32, 4096, 32, 128),
    "gpt3-13b": (13e9, 40, 5120, 40, 128),
    "gpt3-175b": (175e9, 96, 12288, 96, 128),
}


def load_config(name: str) -> GPTConfig:
    return GPTConfig.from_dict(yaml.safe_load((CONFIG_DIR / f"{name}.yaml").read_text()))


def test_every_size_config_exists():
    assert {p.stem for p in CONFIG_DIR.glob("gpt3-*.yaml")} == set(PAPER)


@pytest.mark.parametrize("name", sorted(PAPER))
def test_gpt3_shapes_and_parameter_count_match_the_paper(name):
    params, layers, d_model, heads, d_head = PAPER[name]
    cfg = load_config(name)
    assert (cfg.n_layer, cfg.d_model, cfg.n_head, cfg.d_head) == (layers, d_model, heads, d_head)
    assert (cfg.seq_len, cfg.vocab_size, cfg.d_ff) == (2048, 50257, 4 * d_model)
    with torch.device("meta"):
        model = GPT(cfg)
    counted = count_parameters(model)
    assert abs(counted - params) / params < 0.02, f"{name}: {counted:,} parameters vs paper {params:,.0f}"
    # Independent count: per layer 4d² + 2·d·d_ff weights, 3d + d + d_ff + d biases, 2 LayerNorms; embeddings.
    d, f, L = d_model, 4 * d_model, layers
    per_layer = 4 * d * d + 2 * d * f + (3 * d + d + f + d) + 4 * d
    assert counted == L * per_layer + 50257 * d + 2048 * d + 2 * d


def test_embedding_and_unembedding_are_one_tensor():
    model = build(GPTConfig(n_layer=1, n_head=2, d_model=16, seq_len=8, vocab_size=50))
    assert model.head.lm_head.weight is model.embedding.wte.weight
    x = torch.randint(0, 50, (2, 8))
    model(x, x).backward()
    # The tied matrix gets gradient from both the lookup and the output projection.
    grad = model.embedding.wte.weight.grad
    unused_rows = sorted(set(range(50)) - set(x.flatten().tolist()))
    assert grad[unused_rows].abs().sum() > 0  # only the unembedding touches rows never looked up


def test_init_is_seeded_and_follows_gpt2_scheme():
    cfg = GPTConfig(n_layer=8, n_head=4, d_model=256, seq_len=64, vocab_size=1000)
    a, b, c = build(cfg, seed=1), build(cfg, seed=1), build(cfg, seed=2)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
        if pa.dim() == 2:
            assert not torch.equal(pa, pc), name
    block = a.layers[1]
    assert block.attn.qkv.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert block.attn.proj.weight.std().item() == pytest.approx(0.02 / 16**0.5, rel=0.05)  # 1/√(2L), L=8
    assert block.mlp.proj.weight.std().item() == pytest.approx(0.02 / 16**0.5, rel=0.05)
    assert torch.all(block.attn.qkv.bias == 0) and torch.all(block.ln_1.weight == 1)


def test_sharded_parameter_gets_its_slice_of_the_full_draw():
    cfg = GPTConfig(n_layer=2, n_head=4, d_model=32, seq_len=8, vocab_size=64)
    full = build(cfg, seed=3)
    with torch.device("meta"):
        part = GPT(cfg)
    qkv = part.layers[1].attn.qkv
    qkv.weight = torch.nn.Parameter(torch.empty(48, 32, device="meta"))  # rows 48:96 of (96, 32)
    qkv.weight.full_shape = (96, 32)
    qkv.weight.shard_of = lambda t: t[48:96]
    part.materialize("cpu", seed=3)
    assert torch.equal(part.layers[1].attn.qkv.weight, full.layers[1].attn.qkv.weight[48:96])
    assert torch.equal(part.layers[2].mlp.fc.weight, full.layers[2].mlp.fc.weight)


def test_forward_matches_hand_written_gpt():
    """The layer stack equals an independent re-implementation of the GPT-2 forward pass."""
    cfg = GPTConfig(n_layer=2, n_head=2, d_model=16, seq_len=8, vocab_size=40, attention_impl="reference")
    model = build(cfg, seed=0).double()
    idx = torch.randint(0, 40, (3, 8))
    F = torch.nn.functional
    h = model.embedding.wte.weight[idx] + model.embedding.wpe.weight[:8]
    for blk in model.layers[1:-1]:
        x = F.layer_norm(h, (16,), blk.ln_1.weight, blk.ln_1.bias)
        qkv = (x @ blk.attn.qkv.weight.T + blk.attn.qkv.bias).view(3, 8, 2, 3, 8)
        q, k, v = (qkv[:, :, :, i].transpose(1, 2) for i in range(3))  # (B, H, T, hd)
        s = q @ k.transpose(-1, -2) / 8**0.5
        s = s.masked_fill(torch.triu(torch.ones(8, 8, dtype=torch.bool), 1), float("-inf"))
        y = (s.softmax(-1) @ v).transpose(1, 2).reshape(3, 8, 16)
        h = h + y @ blk.attn.proj.weight.T + blk.attn.proj.bias
        x = F.layer_norm(h, (16,), blk.ln_2.weight, blk.ln_2.bias)
        m = F.gelu(x @ blk.mlp.fc.weight.T + blk.mlp.fc.bias, approximate="tanh")
        h = h + m @ blk.mlp.proj.weight.T + blk.mlp.proj.bias
    wte = model.embedding.wte.weight[:40]  # the vocabulary padded to 128 rows: the first 40 are its tokens
    logits = F.layer_norm(h, (16,), model.head.ln_f.weight, model.head.ln_f.bias) @ wte.T
    torch.testing.assert_close(model(idx), logits)


def test_tiny_model_overfits_one_batch():
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=2, n_head=2, d_model=64, seq_len=16, vocab_size=64)
    model = build(cfg, seed=0)
    batch = torch.randint(0, 64, (4, 17))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95))
    first = None
    for _ in range(150):
        loss = model(batch[:, :-1], batch[:, 1:])
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert first > 3.5  # ≈ ln 64 at init
    assert loss.item() < 0.05


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"n_head": 5}, "not divisible by model.n_head=5"),
        ({"activation": "swish"}, "model.activation='swish': must be one of"),
        ({"attention_pattern": "sparse"}, "must be one of ['dense', 'alternating']"),
        ({"n_layer": 0}, "model.n_layer=0: must be a positive integer"),
    ],
)
def test_bad_model_values_are_named(overrides, message):
    with pytest.raises(ValueError, match=None) as err:
        GPTConfig(**overrides)
    assert message in str(err.value)


def test_unknown_model_key_is_named():
    with pytest.raises(ValueError) as err:
        GPTConfig.from_dict({"n_layers": 3})
    assert "unknown model key(s) ['n_layers']" in str(err.value) and "n_layer" in str(err.value)


def test_alternating_pattern_bands_odd_layers():
    cfg = GPTConfig(attention_pattern="alternating", local_window=32, n_layer=4)
    assert [cfg.window_of(i) for i in range(4)] == [None, 32, None, 32]
    assert [GPTConfig().window_of(i) for i in range(4)] == [None] * 4


def test_sequence_longer_than_position_table_is_refused():
    model = build(GPTConfig(n_layer=1, n_head=1, d_model=8, seq_len=4, vocab_size=10))
    with pytest.raises(ValueError, match="exceeds model.seq_len=4"):
        model(torch.zeros(1, 5, dtype=torch.long))


def test_tied_matrix_is_drawn_as_the_embedding():
    """A layer holding only the embedding (a first pipeline stage) draws the same tied matrix."""
    from model.init import init_layer_
    from model.layers import Embedding

    cfg = GPTConfig(n_layer=2, n_head=2, d_model=16, seq_len=8, vocab_size=50)
    model = build(cfg, seed=5)
    alone = Embedding(cfg)
    init_layer_(alone, 0, seed=5, n_layer=2, std=0.02)
    assert torch.equal(model.embedding.wte.weight, alone.wte.weight)
    assert torch.equal(model.head.lm_head.weight, alone.wte.weight)


def test_activation_checkpointing_gives_the_same_gradients():
    cfg = GPTConfig(n_layer=3, n_head=2, d_model=16, seq_len=8, vocab_size=30)
    plain = build(cfg, seed=4)
    ckpt = build(cfg, seed=4, modes=LayerModes(activation_checkpointing=2))  # segments [block 0, block 1], [block 2]
    idx = torch.randint(0, 30, (2, 8))
    plain(idx, idx).backward()
    ckpt(idx, idx).backward()
    for (name, a), b in zip(plain.named_parameters(), ckpt.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-7, msg=name)


@pytest.mark.parametrize("path", sorted(CONFIG_DIR.glob("*.yaml")), ids=lambda p: p.stem)
def test_model_config_files_have_exactly_the_dataclass_fields(path):
    import dataclasses

    keys = set(yaml.safe_load(path.read_text()))
    assert keys == {f.name for f in dataclasses.fields(GPTConfig)}
    assert yaml.safe_load(path.read_text())["name"] == path.stem
