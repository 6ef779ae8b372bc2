"""`train.*`: the run itself — its length and batches, evaluation, checkpoints, device and precision,
the end-of-run sample, and the guards against non-finite steps and hangs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Optional

from train.config.settings import (
    BOOLEAN,
    NON_NEGATIVE_INT,
    POSITIVE_INT,
    POSITIVE_SECONDS,
    Check,
    Section,
    non_negative_int,
    one_of,
    setting,
)

DEVICES = ("auto", "cpu", "cuda")
PRECISIONS = ("auto", "fp32", "autocast", "bf16", "fp8")
FP8_RECIPES = ("tensorwise", "rowwise")  # model/float8.py
FP8_LINEARS = ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj")  # a block's linears (model.modes.BLOCK_LINEARS)
FP8_BY_RULE, FP8_ALL = "auto", "all"  # train.fp8_linears: by the rule (train/planner/fp8_rule.py), every block linear


def _fp8_linears(value) -> bool:
    if value in (FP8_BY_RULE, FP8_ALL):
        return True
    names = list(value) if isinstance(value, (list, tuple)) else None
    return names is not None and len(set(names)) == len(names) and all(n in FP8_LINEARS for n in names)


FP8_LINEARS_CHECK = Check(_fp8_linears, f"must be {FP8_BY_RULE}, {FP8_ALL}, or a list of distinct block linears from "
                                        f"{list(FP8_LINEARS)}, e.g. [mlp.fc,mlp.proj]")
OVERWRITE = "overwrite"  # train.resume: move an earlier run in the run folder aside (train/run/run_folder.py)
SEED = Check(lambda v: isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**31, "must be an integer in [0, 2^31)")


@dataclass
class BatchRampConfig(Section):
    """`train.batch_ramp.*`: GPT-3's batch-size ramp (train/run/batch_ramp.py checks it against the model)."""

    PREFIX: ClassVar[str] = "train.batch_ramp"
    start: Any = setting(None, "the first global batch, in `unit`s (GPT-3: 32768 tokens); null: no ramp")
    unit: str = setting("sequences", "the unit of start and increment: `sequences`, or `tokens` (whole sequences of "
                                     "model.seq_len)")
    increment: Any = setting(None, "the batch grows by this much at a time, in `unit`s (null: by start)")
    tokens: Any = setting(None, "tokens over which the batch grows from start to train.global_batch_size (GPT-3: 4e9 "
                                "to 12e9)")


@dataclass
class TrainConfig(Section):
    """`train.*` (see the module docstring)."""

    PREFIX: ClassVar[str] = "train"
    seed: int = setting(1234, "seed for the weights' init, the data order and sampling", SEED)
    global_batch_size: int = setting(8, "sequences per optimizer step, over all data-parallel ranks", POSITIVE_INT)
    micro_batch_size: int = setting(8, "sequences per forward/backward on one rank; the rest is gradient accumulation",
                                    POSITIVE_INT)
    batch_ramp: BatchRampConfig = setting(doc="GPT-3's batch-size ramp: the global batch grows from `start` by "
                                              "`increment` to train.global_batch_size over the first `tokens` tokens",
                                          factory=BatchRampConfig)
    max_steps: int = setting(300, "optimizer steps to run", POSITIVE_INT)
    eval_interval: int = setting(100, "steps between validation passes (and at the end); 0 disables", NON_NEGATIVE_INT)
    eval_batches: int = setting(4, "global batches of held-out windows per validation pass (a small corpus: as many "
                                   "as 10% of it holds, with a note)", NON_NEGATIVE_INT)
    eval_tasks: Any = setting(doc="GPT-3's tasks scored during training, e.g. [lambada,piqa] (their files, shots and "
                                  "batch: evaluate.*; docs/evaluation.md); []: none", factory=list)
    eval_tasks_interval: int = setting(0, "steps between scores of train.eval_tasks (and at the end), at logged steps; "
                                          "0: with each validation pass (train.eval_interval)", NON_NEGATIVE_INT)
    checkpoint_interval: int = setting(100, "steps between checkpoints (and at the end); 0 keeps only the final one",
                                       NON_NEGATIVE_INT)
    resume: Optional[str] = setting(
        "auto", "`auto`: continue from the run folder's newest intact checkpoint, at any layout; `none`: start afresh; "
                "`overwrite`: move an earlier run in the run folder aside (<dir>.replaced-<time>) and start afresh; or "
                "a checkpoint path. A fresh start in a run folder with checkpoints is refused",
        Check(lambda v: v is None or isinstance(v, str), f"must be auto, none, {OVERWRITE}, or a checkpoint path"))
    keep_checkpoints: int = setting(3, "keep the newest N checkpoints", POSITIVE_INT)
    keep_every: int = setting(0, "also keep every checkpoint whose step is a multiple of this",
                              non_negative_int("keep none extra"))
    async_checkpoint: Any = setting(
        "auto", "write checkpoints in the background once staged to host memory: `true`, `false`, `auto` (true on "
                "CUDA, false on the CPU)",
        Check(lambda v: v == "auto" or isinstance(v, bool), "must be auto, true or false"))
    init_from: Optional[str] = setting(None, "start from a Hugging Face GPT-2 folder (python -m train.export writes "
                                             "one)")
    device: str = setting("auto", "`auto` (cuda if available, else cpu), `cpu`, `cuda`", one_of(*DEVICES))
    precision: str = setting(
        "auto", "`auto` (bf16 on CUDA, fp32 on CPU), `fp32`, `autocast` (fp32 weights under bf16 autocast), `bf16` "
                "(bf16 weights, fp32 masters and moments in the optimizer), `fp8` (bf16, and the blocks' linears in float8; "
                "GPUs of compute capability ≥ 8.9; train/runtime/precision.py)", one_of(*PRECISIONS))
    fp8_recipe: str = setting("tensorwise", "with fp8: `tensorwise` (one scale per tensor, gradients e5m2) or "
                                            "`rowwise` (one scale per row, all e4m3)", one_of(*FP8_RECIPES))
    fp8_linears: Any = setting(
        FP8_BY_RULE, "with fp8, which of each block's linears compute in float8: `auto` (those whose product shapes, "
                     "after tensor-parallel sharding, make float8 faster: the GPU's measured table "
                     "configs/plan/fp8/PRESET.json, else torchao's thresholds; train/planner/fp8_rule.py), `all`, or a "
                     "list of attn.qkv, attn.proj, mlp.fc, mlp.proj; the rest and the head compute in bf16",
        FP8_LINEARS_CHECK)
    sample_tokens: int = setting(64, "tokens sampled after training (0 to skip)", NON_NEGATIVE_INT)
    sample_prompt: str = setting("The", "the prompt of the end-of-run sample")
    max_consecutive_skips: int = setting(5, "stop after this many steps in a row skipped for a non-finite loss or "
                                            "gradient", POSITIVE_INT)
    step_timeout_s: Any = setting(1800, "a step (or evaluation, or checkpoint) running longer is a hang: write stacks, "
                                        "exit 3; the first step after a start gets 3× as long", POSITIVE_SECONDS)
    peer_timeout_s: Any = setting(20, "a rank that hears nothing from its peer in the ring (or from the rendezvous "
                                      "store) for this long takes the peer's process or node for gone: it writes the "
                                      "host to <run dir>/lost-nodes.txt and every rank exits 3 (train/guard/peers.py)",
                                  POSITIVE_SECONDS)
    collective_timeout_s: Any = setting(3600, "the process group's timeout: a collective waiting longer fails",
                                        POSITIVE_SECONDS)
    reset_schedule: bool = setting(False, "on resume: follow changed schedule settings (LR, warmup, decay, batch, "
                                          "max_steps) instead of the checkpoint's", BOOLEAN)
    fused_loss: bool = setting(True, "the loss unembeds the final hidden states chunk by chunk (model/fused_loss.py), "
                                     "never holding the (B, T, vocabulary) logits; false: full logits, then "
                                     "cross-entropy", BOOLEAN)

    def check(self) -> None:
        from train.config.sections.evaluate import check_tasks

        check_tasks("train.eval_tasks", self.eval_tasks, empty_ok=True)
