"""What a newcomer meets in a first hour, through the commands: one text file trains with the default data,
batch and evaluation settings at dp=1 and dp=2, speaking at once (its first line before anything is built,
its first step's line as soon as the step ends) and without DeepSpeed's warnings; a warmup set by hand is
the one trained; the run ends with its curves (and TensorBoard events when asked), several runs' curves
labelled by what differs; running it again says it is finished; other data or another model size in its
folder, a warmup longer than the run, data=files without data.paths, an undecodable file, a corpus too
small to validate on and a wrong shape for generation are each one line saying what to do; generation
needs no model settings; every command answers --help in gpt3d's words.

One tiny model (2 blocks of width 32) at the default model.seq_len=128, train.global_batch_size=8 and
train.eval_batches=4, on 100 KB of prose: a tenth of it holds 2 of the 4 validation batches asked for.
Two training runs (one process, then two with ZeRO-1), the rest refusals and short commands."""

from __future__ import annotations

import dataclasses
import math
import subprocess

import pytest
from cli import assert_same_losses, generate, metrics, run_module
from data_corpus import prose, write_small_corpora

from train.config.sections import EvaluateConfig, GenerateConfig, PlanConfig
from train.monitor.charts import read_back

# optim.lr: 5e-4, not the toy's 3e-3: Adam's first steps turn dp=2's other summation order into a gradient-norm
# difference that grows with the LR (1e-4 relative, the fp32 tolerance, by step 2 with 3e-3 and by step 4 with 1e-3).
# optim.warmup_tokens set by hand, as a recipe does: half of the run's 4 × 8 × 128 = 4,096 tokens, used as given
# (the default's cap, 10% of the run, would be 409 tokens). A record every 2 steps: step 1 has a line of its own.
SMALL = ["model.n_layer=2", "model.n_head=2", "model.d_model=32", "train.micro_batch_size=4", "train.max_steps=4",
         "train.eval_interval=2", "logging.log_interval=2", "train.sample_tokens=0", "optim.lr=5e-4",
         "optim.warmup_tokens=2048"]
RUN_TOKENS, PEAK, WARMUP = 4 * 8 * 128, 5e-4, 2048
COMMANDS = ["train", "train.evaluate", "train.harness", "train.generate", "train.plan", "train.curves", "train.export",
            "train.prepare_data"]


def run(*args: str, module: str = "train", kind: str = "python", nproc: int = 1) -> subprocess.CompletedProcess:
    """`python -m <module> <args>` started as `kind` says (cli.launcher: by default forked from the warm
    interpreter, the same code run as __main__; `process`: the fresh interpreter a newcomer starts)."""
    return run_module(module, list(args), kind, nproc)


def train(run_dir, path, *overrides, **launch) -> subprocess.CompletedProcess:
    """`python -m train` on one file with data=files' defaults, the SMALL model and schedule."""
    return run(f"hydra.run.dir={run_dir}", "data=files", f"data.paths=[{path}]", *SMALL, *overrides, **launch)


def refused(proc: subprocess.CompletedProcess, *words: str) -> None:
    """One line on stderr holding `words`, exit 2, no traceback, before any model was built."""
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert all(w in proc.stderr for w in words), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "model toy" not in proc.stdout
    assert len([line for line in proc.stderr.splitlines() if line.startswith("gpt3d: error:")]) == 1


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    return write_small_corpora(tmp_path_factory.mktemp("small"))


@pytest.fixture(scope="module")
def first(tmp_path_factory, corpora):
    """The 100 KB file at dp=1, W&B offline, TensorBoard events on: (run folder, its output)."""
    run_dir = tmp_path_factory.mktemp("first") / "run"
    proc = train(run_dir, corpora["100k"], "logging.tensorboard=true", kind="process")  # all a first command prints
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir, proc


def gpt3_lr(tokens: int) -> float:
    """GPT-3's schedule at `tokens`, written here: linear warmup over WARMUP, cosine to 10% by RUN_TOKENS."""
    if tokens < WARMUP:
        return PEAK * tokens / WARMUP
    return PEAK * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (tokens - WARMUP) / (RUN_TOKENS - WARMUP))))


def test_one_text_file_trains_with_the_defaults_at_dp1_and_dp2_and_ends_with_its_curves(tmp_path, first, corpora):
    run_dir, proc = first
    assert "2 of the 4 validation batches train.eval_batches asks for" in proc.stdout  # the 10% of 100 KB
    lines = proc.stdout.splitlines()
    started = next(k for k, line in enumerate(lines) if line.startswith("training steps 1–4"))
    header = lines[started - 1]  # the run's first line, printed before anything was built
    assert header.startswith("model toy") and "| data files (1 file) |" in header and "1024 tokens/step" in header
    assert header.endswith(f"run dir {run_dir}") and "untested optimizer" not in proc.stdout
    # step 1 speaks as soon as it ends, though the first record is at step 2 (logging.log_interval=2)
    assert lines[started + 1].startswith("step 1/4 | loss ") and " | eta " in lines[started + 1]
    assert lines[started + 2].startswith("step 2/4 | loss ")
    one = metrics(run_dir)
    assert [r["step"] for r in one] == [2, 4] and [r["step"] for r in one if "val/loss" in r] == [2, 4]
    assert [r["train/lr"] for r in one] == pytest.approx([gpt3_lr(r["tokens"]) for r in one], rel=1e-9)
    assert lines[-1] == f"curves: {run_dir / 'curves.png'}"
    drawn = read_back(run_dir / "curves.png")["runs"][0]["series"]
    assert drawn["train/loss"] == [[r["tokens"] for r in one], [r["train/loss"] for r in one]]
    assert drawn["val/loss"] == [[r["tokens"] for r in one if "val/loss" in r], [r["val/loss"] for r in one if "val/loss" in r]]
    assert drawn["train/lr"][1] == [r["train/lr"] for r in one]

    two = tmp_path / "dp2"  # ZeRO-1 on 2 ranks: the same losses, and none of torch's or DeepSpeed's warnings
    proc2 = train(two, corpora["100k"], "parallel.zero_stage=1", "logging.wandb.mode=disabled", kind="torchrun", nproc=2)
    assert proc2.returncode == 0, proc2.stderr[-3000:]
    assert "FutureWarning" not in proc2.stderr and "untested optimizer" not in proc2.stdout + proc2.stderr
    assert_same_losses(metrics(two), one)
    assert [r["val/loss"] for r in metrics(two) if "val/loss" in r] == pytest.approx(
        [r["val/loss"] for r in one if "val/loss" in r], rel=1e-5)

    both = run(str(run_dir), str(two), "--out", str(tmp_path / "both.png"), module="train.curves")
    assert both.returncode == 0 and both.stdout.strip() == str(tmp_path / "both.png")
    runs = read_back(tmp_path / "both.png")["runs"]
    assert [r["run"] for r in runs] == [str(run_dir), str(two)]
    assert runs[1]["series"]["train/loss"][1] == [r["train/loss"] for r in metrics(two)]
    # labelled by folder name and the settings that differ (not the data, the model or the schedule they share)
    assert runs[0]["label"].startswith(f"{run_dir.name} ") and runs[1]["label"].startswith("dp2 ")
    assert "parallel.zero_stage=0" in runs[0]["label"] and "parallel.zero_stage=1" in runs[1]["label"]
    assert not any(shared in r["label"] for r in runs for shared in ("data.", "model.", "optim."))


def test_tensorboard_events_hold_the_metrics_records(first):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir, _ = first
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    rows = metrics(run_dir)
    for key in ("train/loss", "train/lr", "train/grad_norm", "perf/tokens_per_s", "val/loss"):
        scalars, expected = events.Scalars(key), [r for r in rows if key in r]
        assert [e.step for e in scalars] == [r["step"] for r in expected], key
        assert [e.value for e in scalars] == pytest.approx([r[key] for r in expected], rel=1e-6), key  # (float32)


def test_a_finished_run_run_again_says_so_and_changes_nothing(first, corpora):
    run_dir, _ = first
    before = (run_dir / "metrics.jsonl").read_bytes(), sorted(p.name for p in (run_dir / "wandb").iterdir())
    again = train(run_dir, corpora["100k"], "logging.tensorboard=true")
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.strip() == ("gpt3d: already finished at step 4; raise train.max_steps to go on, or choose a "
                                    "new run folder (hydra.run.dir=PATH)")
    assert "Traceback" not in again.stderr
    assert ((run_dir / "metrics.jsonl").read_bytes(), sorted(p.name for p in (run_dir / "wandb").iterdir())) == before


def test_other_data_or_model_in_a_run_folder_is_one_line_before_any_model(first, corpora):
    run_dir, _ = first
    proc = train(run_dir, corpora["jsonl14"], "train.max_steps=8")
    refused(proc, "was trained on other data: data.paths: text → json files. To resume it",
            "To resume it, set these back", "hydra.run.dir=PATH", "train.resume=overwrite")
    assert "keeping the checkpoint's schedule" not in proc.stdout  # (train.max_steps=8: said only of a run that goes on)
    proc = train(run_dir, corpora["100k"], "model.n_layer=3", "train.max_steps=8")
    refused(proc, "holds another model: it was saved with model.n_layer=2 (now 3); resume with the same model settings; "
                  "to train this model instead, start a new run: another run folder (hydra.run.dir=PATH), or "
                  "train.resume=overwrite")


def test_a_warmup_set_by_hand_that_outlasts_the_run_is_refused_in_one_line(tmp_path, corpora):
    proc = train(tmp_path / "long", corpora["100k"], "optim.warmup_tokens=5000")
    refused(proc, f"optim.warmup_tokens=5,000 does not end before the run's {RUN_TOKENS:,} tokens", "lower "
            "optim.warmup_tokens, raise optim.decay_tokens or train.max_steps, or leave optim.warmup_tokens out")
    assert not (tmp_path / "long").exists()


def test_data_files_without_paths_says_what_it_needs_with_an_example(tmp_path):
    proc = run(f"hydra.run.dir={tmp_path / 'run'}", "data=files")
    refused(proc, "gpt3d: error: data=files needs data.paths: files or globs", "e.g. python -m train data=files "
                  "'data.paths=[input.txt]'")
    assert "is not a setting" not in proc.stderr and not (tmp_path / "run").exists()


def test_generation_takes_the_model_from_the_checkpoint_and_words_a_wrong_shape_for_itself(first):
    run_dir, _ = first
    proc = generate(run_dir, "generate.max_new_tokens=8", "generate.prompt=The")
    assert proc.stdout.startswith("The") and len(proc.stdout.strip()) > len("The")
    wrong = generate(run_dir, "model.n_layer=3", check=False)
    assert wrong.returncode == 2 and "Traceback" not in wrong.stderr
    assert (f"generate.checkpoint={run_dir} holds a model with model.n_layer=2, not 3; generation reads the model from "
            "its checkpoint, so model.* need not be given: drop model.n_layer from the command line") in wrong.stderr


def test_an_undecodable_file_and_a_corpus_too_small_to_validate_name_the_settings_that_fix_them(tmp_path):
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes(prose(30_000).replace("the", "thé").encode("latin-1", "replace"))
    proc = train(tmp_path / "latin1", latin1)
    refused(proc, "latin1.txt: undecodable ×1); if the corpus uses another encoding, set data.encoding (e.g. latin-1, "
                  "cp1252)")
    assert not (tmp_path / "latin1").exists()
    tiny = tmp_path / "tiny.txt"
    tiny.write_text(prose(20_000))
    proc = train(tmp_path / "tiny", tiny)
    refused(proc, "validation may take at most 10% of the corpus's", "too few for one validation batch of 8 windows "
            "of 129 tokens; set train.eval_interval=0 (no validation), or lower train.global_batch_size or model.seq_len")
    assert not (tmp_path / "tiny").exists()  # no run folder holding only .hydra


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_answers_help_with_its_purpose_its_settings_and_two_examples(command):
    proc = run("--help", module=command)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr[-3000:]
    text = proc.stdout
    assert text.startswith(f"usage: python -m {command} ") and "Hydra" not in text and "schema_" not in text
    blocks = text.split("\n\n")  # usage, purpose, settings, examples, where the details are
    examples = next(block for block in blocks if block.startswith("examples:")).splitlines()[1:]
    assert len(examples) == 2 and all(e.startswith(f"  python -m {command} ") for e in examples), examples
    assert len(text.splitlines()) < 60 and "docs/" in text
    section = {"train.evaluate": EvaluateConfig, "train.generate": GenerateConfig, "train.plan": PlanConfig}.get(command)
    for field in dataclasses.fields(section) if section else ():  # a command's own settings, each with its default
        keys = [f"{section.PREFIX}.{field.name}"]
        if dataclasses.is_dataclass(field.default_factory):
            keys = [f"{keys[0]}.{nested.name}" for nested in dataclasses.fields(field.default_factory)]
        assert all(f"  {key} " in text or f"  {key}\n" in text for key in keys), (command, keys)
    if command == "train":  # the other commands, each by its module name
        assert all(f"python -m {other} " in text for other in COMMANDS[1:])
        assert "data=docstrings|files|gpt3_mixture|hub|mixture|prepared|stdlib" in text
