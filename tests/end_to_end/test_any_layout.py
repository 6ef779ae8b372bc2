"""Sequence parallelism with pipelines, and generation at any layout, through the real launchers.

As in test_layouts.py: `python -m train` on gloo ranks (forked as a launcher starts them) on the CPU against the
one-process run of the same config and precision (fp32 and bf16); and `python -m train.generate` at
several layouts reading one checkpoint, against the one-process greedy tokens, computing in fp32 and
in bf16.
"""

from __future__ import annotations

import json

import pytest
from cli import assert_same_losses, generate, metrics, train
from test_layouts import STEPS, corpus, one_process, one_process_bf16, reference  # noqa: F401 (fixtures: the same runs)

# A model that barely trained (small LR) still has varied greedy continuations; GPT-3's banded
# layers with a window of 8, and 32 new tokens after the prompt run past seq_len = 32.
ALTERNATING = ["model.attention_pattern=alternating", "model.local_window=8"]
GREEDY = ["generate.temperature=0", "generate.max_new_tokens=32", "generate.prompt='import os'"]


@pytest.fixture(scope="module")
def extensions(tmp_path_factory):
    """An extension cache for this module's layout runs: one folder, so that they share one warm interpreter
    (TORCH_EXTENSIONS_DIR is part of what chooses it, tests/helpers/warm.py)."""
    return tmp_path_factory.mktemp("torch_extensions")


@pytest.mark.parametrize("nproc, precision", [(4, "fp32"), (8, "fp32"), (4, "bf16")],
                         ids=["tp2-pp2", "tp2-pp2-dp2", "tp2-pp2-bf16"])
def test_sequence_parallel_pipeline_matches_one_process(request, tmp_path, corpus, extensions, nproc, precision):
    """Against the one-process run of the same precision. Also: the run compiles no DeepSpeed op (the empty
    extension cache stays empty)."""
    layout = ["parallel.tp=2", "parallel.pp=2", "parallel.sequence_parallel=true", f"train.precision={precision}"]
    proc = train(tmp_path / "run", corpus, *STEPS, *layout, kind="ranks", nproc=nproc,
                 env={"TORCH_EXTENSIONS_DIR": str(extensions)})
    assert_same_losses(metrics(tmp_path / "run"), reference(request, precision), precision)
    assert not extensions.exists() or not any(extensions.iterdir()), sorted(extensions.rglob("*"))
    assert "built successfully" not in proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def pipelined_run(tmp_path_factory, corpus):
    """2 steps at tp=2 × pp=2 with sequence parallelism, a checkpoint, and the end-of-run sample."""
    run_dir = tmp_path_factory.mktemp("pipelined")
    layout = ["parallel.tp=2", "parallel.pp=2", "parallel.sequence_parallel=true"]
    proc = train(run_dir, corpus, "train.max_steps=2", "train.eval_interval=0", "logging.wandb.mode=disabled",
                 "optim.lr=1e-4", "train.sample_tokens=8", *ALTERNATING, *layout, kind="ranks", nproc=4)
    return run_dir, proc


def greedy_tokens(run_dir, out, *layout, nproc=1) -> list[int]:
    proc = generate(run_dir, *GREEDY, f"generate.output={out}", *layout,  # no model.*: the checkpoint's
                    kind="ranks" if nproc > 1 else "process", nproc=nproc)
    assert "Setting accelerator" not in proc.stderr  # DeepSpeed's warning that tells a CPU user nothing
    return json.loads(out.read_text())["tokens"]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_greedy_generation_at_any_layout_equals_one_process(tmp_path, pipelined_run, precision):
    """In bf16 (what generation computes in on a GPU: train.precision=auto) too, forced on the CPU."""
    run_dir, _ = pipelined_run
    mode = f"train.precision={precision}"
    expected = greedy_tokens(run_dir, tmp_path / "one.json", mode)
    assert len(expected) == 2 + 32 and len(set(expected[-32:])) > 2  # varied new tokens: the check has teeth
    pipelined = greedy_tokens(run_dir, tmp_path / "tp2pp2.json", "parallel.tp=2", "parallel.pp=2", mode, nproc=4)
    assert pipelined == expected
    sequence_parallel = greedy_tokens(run_dir, tmp_path / "tp2sp.json", "parallel.tp=2", "parallel.sequence_parallel=true",
                                      mode, nproc=2)
    assert sequence_parallel == expected


def test_end_of_training_sample_at_a_pipelined_sequence_parallel_layout(pipelined_run):
    _, proc = pipelined_run
    sample = proc.stdout.split("sample:\n", 1)[1]
    assert sample.startswith("The") and len(sample.strip()) > len("The")


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["generate.checkpoint=null"], "generate.checkpoint is not set"),
        (["generate.checkpoint=/nonexistent/run"], "'/nonexistent/run' holds no checkpoint"),
        (["model.d_model=64"], "holds a model with model.d_model=32, not 64; generation reads the model from its "
                               "checkpoint, so model.* need not be given: drop model.d_model from the command line"),
        (["generate.temperature=-1"], "generate.temperature=-1: must be ≥ 0"),
        (["generate.top_k=0"], "generate.top_k=0: must be a positive integer"),
    ],
)
def test_generate_refuses_bad_input_before_any_work(tmp_path, pipelined_run, overrides, message):
    run_dir, _ = pipelined_run
    out = tmp_path / "out.json"
    proc = generate(run_dir, *GREEDY, f"generate.output={out}", *overrides, check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert not out.exists()
