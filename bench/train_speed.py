"""Training speed on one GPU: gpt3d with its Triton attention kernel, gpt3d with PyTorch's SDPA, and a
Hugging Face `transformers` GPT-2 of the same shape (what a user would otherwise pick), in one run.

  python -m bench.train_speed model=gpt3-125m                  # one model size
  python -m bench.train_speed model=gpt3-125m model=gpt3-350m  # several, one table each
  python -m bench.train_speed model=gpt3-1.3b --micro-batch 2  # one model in memory at a time (automatic)
  python -m bench.train_speed model=toy --device cpu --seq-len 64 --steps 2 --warmup 1   # CPU smoke run
  python -m bench.train_speed model=gpt3-760m model=gpt3-1.3b --json rows.json   # also every row as JSON
  python -m bench.train_speed model=gpt3-125m --micro-batch 32 --engine-only bf16   # 65,536 tokens a step
  python -m bench.train_speed model=gpt3-1.3b --fp8-pair       # only the DeepSpeed pair: bf16 and fp8, compiled

Rows, on the same batches:
  gpt3d attention_impl=triton  gpt3d's model with the fused kernel (on the CPU: attention_impl=torch)
                               and training's loss: the fused, chunked unembedding + cross-entropy
  gpt3d attention_impl=… plain loss   the same with full logits, then cross-entropy (train.fused_loss=false)
  gpt3d attention_impl=sdpa    the same model (fused loss) with torch's scaled_dot_product_attention, selected by
                               the model config key `model.attention_impl=sdpa` (the switch for
                               comparison and fallback; "auto" keeps the kernel on GPUs)
  hf-gpt2 sdpa                 transformers.GPT2LMHeadModel, same layers, widths, heads, vocabulary,
                               context, tied embeddings and tanh GELU, attn_implementation="sdpa"
                               (the baseline, *; gpt3d sdpa when transformers is not installed)
  gpt3d deepspeed precision=P  gpt3d's real training step (train/run/step.py: the DeepSpeed engine, as
                               `python -m train` builds it through train.run.build.build) for train.precision
                               P: autocast, bf16, fp8 (tensorwise) and fp8 rowwise, then bf16 and fp8
                               with model.compile ("compiled": eager fp8's casts launch about 70 kernels
                               per linear, which the compiled blocks fuse) on a GPU; fp32, bf16 and fp8
                               on the CPU, whose float8 products are emulated; fp8 reported as SKIPPED
                               with the reason where it cannot run (a GPU before compute capability
                               8.9, no torchao)
--fp8-pair runs only two DeepSpeed rows, one engine in memory at a time: bf16 and fp8 (tensorwise, its
linears as the run chooses them: train/planner/fp8_rule.py), both compiled on a GPU (as fp8 runs), eager on
the CPU; bf16 is the baseline. Every fp8 row prints the run's line saying which linears compute in float8.
The first four rows' step is the math of gpt3d's training loop, written out in plain torch: forward under bf16
autocast (fp32 weights; no autocast on the CPU), mean next-token cross-entropy in fp32, backward,
gradient clipping at 1.0, torch.optim.AdamW(fused=True, betas=(0.9, 0.95), eps=1e-8,
weight_decay=0.1). DeepSpeed's engine (not installed where this was first run), its bookkeeping
and the data pipeline are NOT in that loop: this is the model's own speed. When those models, with
their gradients and AdamW state (16 bytes per parameter), fit together in half the GPU's memory,
their steps alternate, one step of each per round, so clocks and machine load affect them alike;
otherwise (gpt3-760m and larger on 80 GB; --one-at-a-time forces it) each row runs all its rounds
alone and is freed before the next one is built. The first `--warmup` rounds (Triton autotunes in
the first) are not timed. The DeepSpeed rows run after them, one engine at a time, on the same
batches with the same warm-up and timed rounds; the data pipeline stays out of them too.

Columns: step ms = median over the timed rounds (min–max); tokens/s = micro batch × T / step;
MFU = tokens/s × (6N + 12·L·d·T) / peak, the PaLM FLOPs count of train/monitor/metrics.py with N the
parameters without the position table (the same N for every row: one shape); peak = --peak-tflops,
by default the GPU's dense bf16 peak from train/monitor/metrics.py (989 TFLOP/s for H100 SXM and H200) and
none on the CPU; speed× =
tokens/s ÷ the baseline's. Model configs are configs/model/NAME.yaml, read as plain YAML (no Hydra)
for the plain rows and composed with Hydra (configs/config.yaml) for the DeepSpeed rows.

--json PATH writes a JSON list with one object per row, failed and skipped rows included: model,
row, step_ms, tokens_per_s, mfu, peak_gib (null on the CPU and for rows that did not run), gpu (the
GPU's name or "CPU"), commit, micro_batch, seq_len, alternated (whether the row's steps alternated
with other rows' or ran alone), error.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from model import GPT, GPTConfig, build, count_parameters, flops_per_token
from model.modes import LayerModes
from model.vocab import lm_loss
from train.monitor import metrics

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs" / "model"


def load_model_config(name: str) -> dict:
    """configs/model/NAME.yaml as a dict, naming the available configs when NAME is not one."""
    import yaml

    path = CONFIG_DIR / f"{name}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))
        raise SystemExit(f"model={name}: no such config; choose from {known}")
    return yaml.safe_load(path.read_text())


def hf_gpt2(config: GPTConfig, device):
    """transformers.GPT2LMHeadModel of gpt3d's shape with SDPA attention, or an ImportError saying
    transformers is missing."""
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError as err:
        raise ImportError(f"transformers is not installed ({err}): pip install transformers") from err
    special = min(50256, config.vocab_size - 1)  # GPT-2's <|endoftext|>, kept inside small vocabularies
    hf_config = GPT2Config(vocab_size=config.vocab_size, n_positions=config.seq_len, n_embd=config.d_model,
                           n_layer=config.n_layer, n_head=config.n_head, n_inner=config.d_ff,
                           activation_function="gelu_new" if config.activation == "gelu" else "relu",
                           resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, layer_norm_epsilon=config.ln_eps,
                           initializer_range=config.init_std, use_cache=False, tie_word_embeddings=True,
                           bos_token_id=special, eos_token_id=special, attn_implementation="sdpa")
    with torch.device(device):
        model = GPT2LMHeadModel(hf_config)
    if model.config._attn_implementation != "sdpa":
        raise RuntimeError(f"transformers chose attention {model.config._attn_implementation!r}, not 'sdpa'")
    return model


def gpt3d_loss(model, x, y):
    return model(x, y)  # gpt3d: forward(idx, targets) is the mean next-token cross-entropy


def hf_loss(model, x, y):
    return lm_loss(model(input_ids=x).logits, y)  # transformers: the same loss on its logits


STATE_BYTES_PER_PARAMETER = 16  # a plain row's fp32 weights, gradients and AdamW's two moments


class Row:
    """One model being timed: its step, its timings, peak memory and losses, or why it failed. The
    model is built by `build()`, so that a row can wait for the one before it to be freed."""

    alternated = True

    def __init__(self, name, make_model, loss_fn, device):
        self.name, self.make_model, self.loss_fn, self.device = name, make_model, loss_fn, device
        self.step_s, self.losses, self.peak_gib, self.error, self.skipped = [], [], 0.0, None, None
        self.model = self.opt = None

    def build(self):
        try:
            self.model = self.make_model()
            self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, betas=(0.9, 0.95), eps=1e-8,
                                         weight_decay=0.1, fused=True)
        except Exception as err:  # reported in the table, never dropped
            self.fail(err)

    def fail(self, err):
        self.error = f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[0][:160]}"
        self.release()

    def release(self):
        """Free what the row holds (its timings stay), and the GPU's cached blocks with it."""
        self.free()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def free(self):
        """Drop the model and its optimizer state."""
        self.model = self.opt = None

    def step(self, x, y, timed: bool):
        """One training step (train_step); records its time (synchronised) when timed, its loss and peak."""
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
            torch.cuda.synchronize(self.device)
        start = time.perf_counter()
        try:
            loss = self.train_step(x, y)
        except Exception as err:  # out of memory, a kernel that fails: reported, the others go on
            self.fail(err)
            return
        if timed:
            self.step_s.append(time.perf_counter() - start)
        self.losses.append(float(loss))
        if cuda:
            self.peak_gib = max(self.peak_gib, torch.cuda.max_memory_allocated(self.device) / 2**30)

    def train_step(self, x, y) -> torch.Tensor:
        """The plain step: forward under bf16 autocast (GPU), backward, clipping, AdamW; synchronised."""
        cuda = self.device.type == "cuda"
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=cuda):
            loss = self.loss_fn(self.model, x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0, foreach=True)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize(self.device)
        return loss.detach()


def plain_rows_fit(n_params: int, n_rows: int, device) -> tuple[bool, str]:
    """Whether the plain rows' models, gradients and AdamW state fit together in half the GPU's memory
    (the rest for activations); and the reason, when they do not. Always on a CPU."""
    if device.type != "cuda":
        return True, ""
    total = torch.cuda.get_device_properties(device).total_memory
    need = n_rows * STATE_BYTES_PER_PARAMETER * n_params
    if need <= total / 2:
        return True, ""
    return False, (f"{n_rows} models' weights, gradients and AdamW state would take {need / 2**30:.0f} GiB together, "
                   f"over half of the GPU's {total / 2**30:.0f} GiB")


def run_plain_rows(rows, config: GPTConfig, micro_batch, warmup, steps, device, alone: bool):
    """Every plain row's rounds: alternating, one step of each row per round, or (alone) each row's
    rounds in turn, each model freed before the next one is built. Every row is released at the end."""
    def describe(row):
        if row.name.startswith("hf-gpt2") and row.model is not None:
            hf_n = sum(p.numel() for n, p in row.model.named_parameters() if "wpe" not in n)
            print(f"hf-gpt2 parameters without positions: {hf_n / 1e6:.1f}M")

    if alone:
        for row in rows:
            row.alternated = False
            row.build()
            describe(row)
            for round_index, (x, y) in enumerate(batches(config, micro_batch, warmup + steps, device)):
                if row.error is None:
                    row.step(x, y, timed=round_index >= warmup)
            row.release()
        return
    for row in rows:
        row.build()
        describe(row)
    for round_index, (x, y) in enumerate(batches(config, micro_batch, warmup + steps, device)):
        for row in rows:
            if row.error is None:
                row.step(x, y, timed=round_index >= warmup)
    for row in rows:
        row.release()


ENGINE_ROWS = {  # --engine-only's names of the DeepSpeed rows: (train.precision, train.fp8_recipe, compiled)
    "autocast": ("autocast", None, False), "bf16": ("bf16", None, False), "fp8": ("fp8", "tensorwise", False),
    "fp8-rowwise": ("fp8", "rowwise", False), "bf16-compiled": ("bf16", None, True),
    "fp8-compiled": ("fp8", "tensorwise", True),
}


def benchmark(name, config: GPTConfig, micro_batch, warmup, steps, device, peak_tflops, one_at_a_time=None,
              fp8_pair=False, engine_only=None):
    """The table of one model size; returns its rows (plain ones first, then DeepSpeed's), the tokens
    per step and the FLOPs per token. one_at_a_time: run the plain rows alone, one after the other
    (None: when they do not fit together, plain_rows_fit); fp8_pair: only DeepSpeed's bf16 and fp8 rows;
    engine_only: only these DeepSpeed rows (names of ENGINE_ROWS)."""
    gpt3d_impl = "triton" if device.type == "cuda" else "torch"

    def gpt3d(impl, fused_loss=True):
        # training's loss: fused unembedding + cross-entropy (train.fused_loss, the default;
        # model/fused_loss.py), or full logits then cross-entropy
        return lambda: build(GPTConfig.from_dict({**vars(config), "attention_impl": impl}), device=device, seed=0,
                             modes=LayerModes(fused_loss=fused_loss))

    rows = [Row("hf-gpt2 sdpa", lambda: hf_gpt2(config, device), hf_loss, device),
            Row(f"gpt3d attention_impl={gpt3d_impl}", gpt3d(gpt3d_impl), gpt3d_loss, device),
            Row(f"gpt3d attention_impl={gpt3d_impl} plain loss", gpt3d(gpt3d_impl, fused_loss=False), gpt3d_loss, device),
            Row("gpt3d attention_impl=sdpa", gpt3d("sdpa"), gpt3d_loss, device)]
    n_params = count_parameters(build_meta(config), exclude_positions=True)
    flops_tok = flops_per_token(n_params, config.n_layer, config.d_model, config.seq_len)
    tokens = micro_batch * config.seq_len
    print(f"\n{name}: {config.n_layer} layers, d_model {config.d_model}, {config.n_head} heads of {config.d_head}, "
          f"T={config.seq_len}, micro batch {micro_batch} ({tokens} tokens/step), N={n_params / 1e6:.1f}M without "
          f"positions, {flops_tok / 1e9:.2f} GFLOP/token; {warmup} warm-up + {steps} timed rounds")
    precisions = [("autocast", None, False), ("bf16", None, False), ("fp8", "tensorwise", False),
                  ("fp8", "rowwise", False), ("bf16", None, True), ("fp8", "tensorwise", True)]
    if device.type != "cuda":
        precisions = [("fp32", None, False), ("bf16", None, False), ("fp8", "tensorwise", False)]
    if fp8_pair:  # the DeepSpeed pair alone, compiled where a run under fp8 compiles (a GPU)
        rows, compiled = [], device.type == "cuda"
        precisions = [("bf16", None, compiled), ("fp8", "tensorwise", compiled)]
        print("the DeepSpeed pair only: bf16 and fp8, one engine in memory at a time")
    elif engine_only:
        rows, precisions = [], [ENGINE_ROWS[row] for row in engine_only]
        print(f"the DeepSpeed rows only: {', '.join(engine_only)}, one engine in memory at a time")
    else:
        fit, why = plain_rows_fit(count_parameters(build_meta(config)), len(rows), device)
        alone = (not fit) if one_at_a_time is None else one_at_a_time
        if alone:
            print(f"plain rows one at a time, each freed before the next is built{': ' + why if why else ''}")
        run_plain_rows(rows, config, micro_batch, warmup, steps, device, alone)
    for precision, recipe, compiled in precisions:
        row = EngineRow(name, precision, micro_batch, config.seq_len, device, recipe, compiled)
        for round_index, (x, y) in enumerate(batches(config, micro_batch, warmup + steps, device)):
            if row.error is None:
                row.step(x, y, timed=round_index >= warmup)
        row.release()
        rows.append(row)
    print_table(rows, tokens, flops_tok, peak_tflops)
    return rows, tokens, flops_tok


def batches(config: GPTConfig, micro_batch: int, rounds: int, device):
    """The benchmark's batches, the same for every row: (inputs (B, T), next tokens (B, T)) per round."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(rounds):
        batch = torch.randint(0, config.vocab_size, (micro_batch, config.seq_len + 1), generator=gen).to(device)
        yield batch[:, :-1], batch[:, 1:]  # (B, T) inputs, (B, T) next tokens


class EngineRow(Row):
    """gpt3d's training step through the DeepSpeed engine (train.run.build.build, then TrainStep), one
    micro batch per step, at train.precision `precision` (fp8: by train.fp8_recipe `recipe`); SKIPPED with
    the reason where it cannot run."""

    def __init__(self, model_name, precision, micro_batch, seq_len, device, recipe=None, compiled=False):
        rowwise, compile_ = " rowwise" if recipe == "rowwise" else "", " compiled" if compiled else ""
        self.name, self.device = f"gpt3d deepspeed precision={precision}{rowwise}{compile_}", device
        self.step_s, self.losses, self.peak_gib, self.error, self.skipped = [], [], 0.0, None, None
        self.trainer = None
        self.alternated = False
        if precision == "fp8":
            from train.runtime.precision import fp8_refusal

            refusal = fp8_refusal(device)
            if refusal is not None:
                self.skipped = self.error = f"SKIPPED: {refusal}"
                return
        try:
            self.trainer = engine_trainer(model_name, precision, micro_batch, seq_len, device, recipe, compiled)
        except Exception as err:  # reported in the table, never dropped
            self.fail(err)
            return
        if self.trainer.spec.fp8_line is not None:  # which linears compute in float8, and how the blocks run
            print(f"{self.name}: {self.trainer.spec.fp8_line}")

    def free(self):
        """Drop the engine (its weights, optimizer state and data workers)."""
        if self.trainer is not None:
            self.trainer.batches.close()
            self.trainer = None

    def train_step(self, x, y) -> float:
        result = self.trainer.step(torch.cat([x, y[:, -1:]], dim=1))  # the windows (B, T + 1)
        return float(result.loss)  # the step's one host sync, as the loop's logging makes


def engine_trainer(model_name, precision, micro_batch, seq_len, device, recipe=None, compiled=False):
    """train.run.build.build for one model at train.precision `precision` (and train.fp8_recipe `recipe`, and
    model.compile `compiled`), one micro batch per step."""
    from hydra import compose, initialize_config_dir

    from train.config.entry import CONFIG_DIR, register_config
    from train.run.build import build
    from train.run.spec import resolve

    register_config()
    settings = [f"model={model_name}", f"model.seq_len={seq_len}", f"train.precision={precision}",
                f"train.micro_batch_size={micro_batch}", f"train.global_batch_size={micro_batch}",
                f"train.device={device.type}", "data.streams=1", "train.eval_interval=0", "train.sample_tokens=0",
                "logging.wandb.mode=disabled", f"model.compile={str(compiled).lower()}",
                *([f"train.fp8_recipe={recipe}"] if recipe else [])]
    with initialize_config_dir(version_base=None, config_dir=str(CONFIG_DIR), job_name="train_speed"):
        cfg = compose("config", overrides=settings)
    # the overrides as given: model.compile=false then keeps an fp8 row eager, as on the command line
    return build(resolve(cfg, Path(tempfile.mkdtemp(prefix="gpt3d-train-speed-")), settings))


def build_meta(config: GPTConfig):
    """The model on the meta device: shapes and parameter counts, no memory."""
    with torch.device("meta"):
        return GPT(config)


def print_table(rows, tokens, flops_tok, peak_tflops):
    base = next((r for r in rows if r.error is None and r.step_s), None)
    head = (f"{'row':<46} {'step ms':>9} {'(min-max)':>15} {'tokens/s':>10} {'MFU':>6} {'peak GiB':>8} "
            f"{'loss first→last':>16} {'speed×':>7}")
    print(head)
    print("-" * len(head))
    for row in rows:
        mark = " *" if row is base else ""
        if row.skipped:
            print(f"{row.name:<46} {row.skipped}")
            continue
        if row.error is not None or not row.step_s:
            print(f"{row.name + mark:<46} FAILED {row.error or 'no timed step'}")
            continue
        step = statistics.median(row.step_s)
        tok_s = tokens / step
        utilisation = metrics.mfu(tok_s, flops_tok, peak_tflops, 1)
        mfu_text = f"{utilisation:>6.1%}" if utilisation is not None else f"{'n/a':>6}"
        spread = f"({1e3 * min(row.step_s):.1f}-{1e3 * max(row.step_s):.1f})"
        losses = f"{row.losses[0]:.3f}→{row.losses[-1]:.3f}"
        speed = tok_s / (tokens / statistics.median(base.step_s))
        peak = f"{row.peak_gib:>8.1f}" if row.device.type == "cuda" else f"{'n/a':>8}"
        print(f"{row.name + mark:<46} {1e3 * step:>9.1f} {spread:>15} {tok_s:>10.0f} {mfu_text} {peak} "
              f"{losses:>16} {speed:>7.2f}")
    sys.stdout.flush()


def json_records(model_name, rows, tokens, flops_tok, peak_tflops, micro_batch, seq_len, device) -> list[dict]:
    """One JSON-ready dict per row (see the module docstring for the fields)."""
    from bench.attention import git_commit

    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    records = []
    for row in rows:
        ran = row.error is None and bool(row.step_s)
        step = statistics.median(row.step_s) if ran else None
        tok_s = tokens / step if ran else None
        records.append({
            "model": model_name, "row": row.name, "step_ms": 1e3 * step if ran else None, "tokens_per_s": tok_s,
            "mfu": metrics.mfu(tok_s, flops_tok, peak_tflops, 1) if ran else None,
            "peak_gib": row.peak_gib if ran and device.type == "cuda" else None, "gpu": gpu, "commit": git_commit(),
            "micro_batch": micro_batch, "seq_len": seq_len, "alternated": row.alternated,
            "error": None if ran else (row.error or "no timed step")})
    return records


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="+", metavar="model=NAME", help="model config(s) from configs/model/")
    parser.add_argument("--micro-batch", type=int, help="sequences per step (default: 8, or 2 above 1B parameters)")
    parser.add_argument("--seq-len", type=int, help="override the config's context length")
    parser.add_argument("--steps", type=int, default=10, help="timed rounds (default 10)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed rounds first (default 3)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else None,
                        help="cuda (default when available) or cpu, for a smoke run")
    parser.add_argument("--json", metavar="PATH", type=Path, help="also write every row to PATH as a JSON list")
    parser.add_argument("--one-at-a-time", action="store_true", default=None,
                        help="run the plain rows one after the other, each model freed before the next is built "
                             "(default: only when they do not fit together in half the GPU's memory)")
    parser.add_argument("--fp8-pair", action="store_true",
                        help="only the DeepSpeed rows bf16 and fp8, compiled on a GPU (no plain rows)")
    parser.add_argument("--engine-only", metavar="ROWS",
                        help=f"only these DeepSpeed rows, comma-separated, no plain rows: {', '.join(ENGINE_ROWS)}")
    parser.add_argument("--peak-tflops", type=float,
                        help="per-device peak for MFU (default on a GPU: its dense bf16 peak, as the training loop logs it)")
    args = parser.parse_args()
    names = []
    for item in args.overrides:
        key, _, value = item.partition("=")
        if key != "model" or not value:
            parser.error(f"{item!r}: expected model=NAME")
        names.append(value)
    if args.device is None:
        parser.error("no CUDA device: pass --device cpu for a smoke run on the CPU")
    engine_only = args.engine_only.split(",") if args.engine_only else None
    unknown = [row for row in engine_only or [] if row not in ENGINE_ROWS]
    if unknown:
        parser.error(f"--engine-only {args.engine_only!r}: {', '.join(unknown)} is no DeepSpeed row; rows: "
                     f"{', '.join(ENGINE_ROWS)}")
    if args.steps < 1 or args.warmup < 0:
        parser.error(f"--steps {args.steps} must be ≥ 1 and --warmup {args.warmup} ≥ 0")
    configs = {name: load_model_config(name) for name in names}  # every name checked before any work
    device = torch.device(args.device)
    peak = metrics.peak_tflops(device, args.peak_tflops)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (float32, no autocast)"
    print(f"training step speed on {where}; plain rows: bf16 autocast on GPUs, fused AdamW, clip 1.0, no DeepSpeed; "
          f"deepspeed rows: gpt3d's training step through its DeepSpeed engine")
    print(f"torch {torch.__version__}; MFU against {f'{peak:g} TFLOP/s' if peak else 'no peak (n/a)'}; "
          "ratios against the row marked *")
    records = []
    for name, values in configs.items():
        if args.seq_len:
            values = {**values, "seq_len": args.seq_len}
        config = GPTConfig.from_dict(values)
        n = count_parameters(build_meta(config))
        micro_batch = args.micro_batch or (8 if n < 1e9 else 2)
        rows, tokens, flops_tok = benchmark(name, config, micro_batch, args.warmup, args.steps, device, peak,
                                            args.one_at_a_time, args.fp8_pair, engine_only)
        records += json_records(name, rows, tokens, flops_tok, peak, micro_batch, config.seq_len, device)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if args.json:
        metrics.write_atomically(args.json, json.dumps(records, indent=1) + "\n")


if __name__ == "__main__":
    main()
