"""Hugging Face export and import: `transformers` computes what gpt3d computes, and the round trip is exact.

A model trained at tp=2 × pp=2 (4 gloo processes) is exported with `python -m train.export` (one
process, no process group). `transformers`' GPT2LMHeadModel loaded from the folder must give the
one-process gpt3d model's logits (fp32, 1e-5 relative) and its greedy continuation token for
token, and its tokenizer must encode as gpt3d's tiktoken BPE does. A run started from that folder
(`train.init_from`, at tp=2) saves a checkpoint whose export is the same folder's tensors,
bit for bit.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch
from cli import run_module, train
from distributed import run_distributed

from model import GPTConfig, build, generate
from train import checkpoint

LAYOUT = ["parallel.tp=2", "parallel.pp=2"]


def export_cli(*args) -> subprocess.CompletedProcess:
    return run_module("train.export", list(map(str, args)), env=dict(os.environ), timeout=300)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, corpus):
    """2 steps at tp=2 × pp=2, 4 heads, a small LR (varied greedy continuations), then the export."""
    run_dir = tmp_path_factory.mktemp("trained")
    train(run_dir, corpus, "model.n_head=4", "train.max_steps=2", "train.eval_interval=0", "optim.lr=1e-4",
          "logging.wandb.mode=disabled", *LAYOUT, kind="ranks", nproc=4)
    out = run_dir.parent / f"{run_dir.name}-hf"
    proc = export_cli(run_dir / "checkpoints", out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "exported" in proc.stdout and "step00000002" in proc.stdout
    return run_dir, out


def one_process_model(run_dir):
    """gpt3d's own model, one process, holding the checkpoint's weights."""
    from parallel.naming import load_full_
    from parallel.topology import Topology

    folder = checkpoint.tag_folder(run_dir / "checkpoints")
    config = GPTConfig.from_dict(checkpoint.saved_model_config(folder))
    model = build(config, "cpu", seed=0)
    load_full_(model, checkpoint.read_model_weights(folder, config), config, Topology.create())
    return model.eval()


def test_transformers_logits_equal_gpt3d_logits(trained):
    from transformers import GPT2LMHeadModel

    run_dir, hf_dir = trained
    ours, theirs = one_process_model(run_dir), GPT2LMHeadModel.from_pretrained(hf_dir).eval()
    tokens = torch.randint(0, 50257, (2, 32), generator=torch.Generator().manual_seed(0))  # (B, T): the whole context
    with torch.no_grad():
        expected, got = ours(tokens), theirs(tokens).logits  # (B, T, V)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))


def test_transformers_greedy_generation_and_tokenizer_equal_gpt3d(trained):
    from transformers import AutoTokenizer, GPT2LMHeadModel

    from train.data.tokenizer import gpt2

    run_dir, hf_dir = trained
    text = "import os\ndef main():  # héllo <|endoftext|>"
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    assert tokenizer(text)["input_ids"] == gpt2().encode(text, allowed_special="all")
    prompts = torch.randint(0, 50257, (4, 6), generator=torch.Generator().manual_seed(1))  # (B, T0)
    with torch.no_grad():
        expected = generate(one_process_model(run_dir), prompts, 24, temperature=0)  # (B, T0 + 24)
        got = GPT2LMHeadModel.from_pretrained(hf_dir).generate(prompts, max_new_tokens=24, do_sample=False,
                                                               attention_mask=torch.ones_like(prompts))
    assert got.tolist() == expected.tolist()
    assert len(set(expected[:, 6:].flatten().tolist())) > 8  # varied output: the check has teeth


def import_worker(corpus: str, run_dir: str, hf_dir: str) -> None:
    from test_checkpoint_state import compose, save_checkpoint

    from train.run.build import build
    from train.run.spec import resolve

    trainer = build(resolve(compose(corpus, ["parallel.tp=2", f"train.init_from={hf_dir}"]), run_dir))
    save_checkpoint(trainer)  # the imported weights, untrained


def test_import_then_export_is_bit_for_bit(trained, corpus, tmp_path):
    from safetensors.torch import load_file

    _, hf_dir = trained
    run_dir = tmp_path / "imported"
    run_distributed(import_worker, 2, str(corpus), str(run_dir), str(hf_dir), timeout=600)
    proc = export_cli(run_dir / "checkpoints", tmp_path / "again")
    assert proc.returncode == 0, proc.stderr[-3000:]
    before, after = load_file(hf_dir / "model.safetensors"), load_file(tmp_path / "again" / "model.safetensors")
    assert before.keys() == after.keys() and len(before) == 2 + 12 * 3 + 2
    for name, tensor in before.items():
        assert torch.equal(after[name], tensor), name
    assert json.loads((tmp_path / "again" / "config.json").read_text()) == json.loads((hf_dir / "config.json").read_text())


def test_a_layer_permutation_is_what_gpt2_expects():
    """Independent of transformers: GPT-2's c_attn output column j·d + h·d_head + e is gpt3d's qkv
    row h·3·d_head + j·d_head + e (q, k, v = j of head h), and Conv1D stores (in, out)."""
    from train.checkpoint.hugging_face import from_gpt2, to_gpt2

    config = GPTConfig(n_layer=1, n_head=2, d_model=8, seq_len=4, vocab_size=11)
    full = {name: p.detach().clone() for name, p in build(config, "cpu", seed=1).named_parameters()}
    hf = to_gpt2(full, config)
    qkv = full["layers.1.attn.qkv.weight"]  # (3d, d)
    for j in range(3):
        for h in range(2):
            for e in range(4):
                assert torch.equal(hf["transformer.h.0.attn.c_attn.weight"][:, j * 8 + h * 4 + e], qkv[h * 12 + j * 4 + e])
    assert torch.equal(hf["transformer.h.0.mlp.c_fc.weight"], full["layers.1.mlp.fc.weight"].t())
    back = from_gpt2({k.removeprefix("transformer."): v for k, v in hf.items()}, config)  # the Hub's unprefixed names
    assert all(torch.equal(back[name], full[name]) for name in back) and len(back) == len(full)


def test_banded_attention_is_refused_unless_its_window_covers_the_context():
    from train.checkpoint.hugging_face import ExportError, check_exportable

    with pytest.raises(ExportError, match="no transformers architecture computes this model"):
        check_exportable(GPTConfig(attention_pattern="alternating", local_window=8, seq_len=32))
    check_exportable(GPTConfig(attention_pattern="alternating", local_window=32, seq_len=32))  # banded = dense


def test_export_refuses_bad_paths_clearly(trained, tmp_path, capsys):
    from train.export import main

    run_dir, _ = trained
    assert main([str(tmp_path / "nowhere"), str(tmp_path / "out")]) == 2
    assert "holds no checkpoint" in capsys.readouterr().err and not (tmp_path / "out").exists()
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "mine.txt").write_text("keep me")
    assert main([str(run_dir / "checkpoints"), str(taken)]) == 2
    assert "already exists" in capsys.readouterr().err
    assert [p.name for p in taken.iterdir()] == ["mine.txt"] and not list(tmp_path.glob(".taken.tmp-*"))


def test_init_from_another_shape_fails_before_any_work(trained, corpus, tmp_path):
    _, hf_dir = trained
    run_dir = tmp_path / "run"
    proc = train(run_dir, corpus, "model.n_head=4", "model.seq_len=64", f"train.init_from={hf_dir}", check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "holds another model shape; set model.seq_len=32 (now seq_len=64)" in proc.stderr
    assert not run_dir.exists()


def test_init_from_reads_safetensors_only(trained, tmp_path):
    from train.checkpoint.hugging_face import ExportError, check_init_from

    _, hf_dir = trained
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text((hf_dir / "config.json").read_text())
    (pickled / "pytorch_model.bin").write_bytes(b"\x80\x04pickle")
    config = GPTConfig(n_layer=3, n_head=4, d_model=32, d_ff=512, seq_len=32)
    with pytest.raises(ExportError, match="only safetensors weights are read"):
        check_init_from(pickled, config)
    check_init_from(hf_dir, config)  # the real folder passes
