"""Checkpoints tampered with as a hostile user would, the manifest recomputed so that every checksum
matches: each is passed over with one warning for the previous intact checkpoint, or refused in one
line, never loaded and never a traceback.

One run (one process, 4 steps, checkpoints at steps 2 and 4) is the fixture for the cases one at a
time: a case tampers with a copy's step 4, and `select` (what a resume uses) must pass it over with
one warning. Through the CLI, every case at once: a run with one checkpoint per case, each tampered
with one case, must warn once for each, take step 2 and log every later step exactly as the
uninterrupted run did (resuming is exact: DESIGN.md invariant 5), which is the independent reference
for "the run continues as from the intact checkpoint".
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
from cli import metrics, train

from train.checkpoint import files
from train.checkpoint import integrity as checkpoint

RUN = ["train.eval_interval=0", "logging.wandb.mode=disabled", "train.checkpoint_interval=2"]  # keeps 3
KEYS = ("step", "train/loss", "train/lr", "train/grad_norm")


@pytest.fixture(scope="module")
def trained(tmp_path_factory, corpus):
    run_dir = tmp_path_factory.mktemp("tamper") / "run"
    train(run_dir, corpus, *RUN, "train.max_steps=4")
    return run_dir


@pytest.fixture
def run(tmp_path, trained) -> Path:
    return Path(shutil.copytree(trained, tmp_path / "run", symlinks=True))


def step_folder(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / files.step_tag(step)


def forge_manifest(folder: Path) -> None:
    """Rewrite the manifest to match the files as they now are."""
    manifest = json.loads((folder / files.MANIFEST).read_text())
    manifest["files"] = {name: files.describe(folder / name) for name in manifest["files"]}
    (folder / files.MANIFEST).write_text(json.dumps(manifest))


def edit_json(folder: Path, name: str, change, forge: bool = True) -> None:
    value = json.loads((folder / name).read_text())
    change(value)
    (folder / name).write_text(json.dumps(value))
    if forge:
        forge_manifest(folder)


def edit_header(folder: Path, change) -> None:
    """Rewrite the safetensors header of the folder's shard (data unchanged), then the manifest."""
    file = sorted(folder.glob("*.safetensors"))[0]
    raw = file.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + length])
    change(header)
    text = json.dumps(header).encode()
    file.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + length:])
    forge_manifest(folder)


def sharding(change):
    def apply(header):
        info = json.loads(header["__metadata__"]["DCP_SHARDING_INFO"])
        change(info)
        header["__metadata__"]["DCP_SHARDING_INFO"] = json.dumps(info)
    return apply


def put(path, value):
    """A change setting a path (dotted, or a tuple of keys) of a JSON value."""
    def change(doc):
        *parents, last = path.split(".") if isinstance(path, str) else path
        for key in parents:
            doc = doc[int(key)] if isinstance(doc, list) else doc[key]
        doc[int(last) if isinstance(doc, list) else last] = value
    return change


def drop(path: str):
    def change(doc):
        *parents, last = path.split(".")
        for key in parents:
            doc = doc[int(key)] if isinstance(doc, list) else doc[key]
        del doc[last]
    return change


def choose(run_dir: Path) -> tuple[str, list[str]]:
    warnings = []
    return checkpoint.select(run_dir / "checkpoints", warn=warnings.append)[0].name, warnings


WPE = "model/layers.0.wpe.weight"
BATCH = ("extra", "schedule", "config", "train.global_batch_size")
# (name, tamper(step 4 folder), words the one warning must hold): the manifest recomputed unless said
CASES = [
    ("peak-lr-stale-manifest", lambda f: edit_json(f, "state.json", put("extra.schedule.resolved.peak_lr", 50.0),
                                                   forge=False), "state.json"),
    ("batch-stale-manifest", lambda f: edit_json(f, "state.json", put(BATCH, 8), forge=False), "state.json"),
    ("negative-step", lambda f: edit_json(f, "state.json", put("step", -5)), "step=-5"),
    ("boolean-step", lambda f: edit_json(f, "state.json", put("step", True)), "step=True"),
    ("float-step", lambda f: edit_json(f, "state.json", put("step", 1e12)), "step=1000000000000.0"),
    ("step-of-another-folder", lambda f: edit_json(f, "state.json", put("step", 2)), "named for step 4"),
    ("negative-tokens", lambda f: edit_json(f, "state.json", put("tokens", -128)), "tokens=-128"),
    ("engine-extra-key", lambda f: edit_json(f, "state.json", put("engine.optimizer", 1)), "engine holds unknown"),
    ("negative-adam-step", lambda f: edit_json(f, "state.json", put("optimizer.adam_step", -1)), "adam_step=-1"),
    ("lr-scheduler-without-tokens", lambda f: edit_json(f, "state.json", put("lr_scheduler", {})),
     "lr_scheduler lacks ['tokens']"),
    ("negative-windows", lambda f: edit_json(f, "state.json", put("data.windows_served", -4)), "windows_served=-4"),
    ("lane-cursor", lambda f: edit_json(f, "state.json", put(("data", "lanes", "0/0", "cursor"), {"epoch": -1})),
     "cursor lacks"),
    ("data-not-a-dict", lambda f: edit_json(f, "state.json", put("data", [1, 2])), "data is [1, 2]"),
    ("extra-schedule-key", lambda f: edit_json(f, "state.json", put("extra.schedule.resolved.warmup", 3)),
     "unknown keys ['warmup']"),
    ("negative-peak-lr", lambda f: edit_json(f, "state.json", put("extra.schedule.resolved.peak_lr", -1.0)),
     "peak_lr=-1.0"),
    ("unknown-top-key", lambda f: edit_json(f, "state.json", put("__class__", "x")), "unknown keys ['__class__']"),
    ("rng-truncated", lambda f: edit_json(f, "rng.json", lambda r: r["ranks"][0].update(
        torch=r["ranks"][0]["torch"][:400])), "ranks[0].torch"),
    ("rng-bad-base64", lambda f: edit_json(f, "rng.json", put("ranks.0.torch", "not base64!")), "ranks[0].torch"),
    ("rng-wrong-type", lambda f: edit_json(f, "rng.json", put("ranks.0.python", "abc")), "ranks[0].python"),
    ("rng-python-words", lambda f: edit_json(f, "rng.json", put("ranks.0.python.1.0", 2**40)), "python[1][0]"),
    ("rng-missing-key", lambda f: edit_json(f, "rng.json", drop("ranks.0.python")), "lacks ['python']"),
    ("rng-no-ranks", lambda f: edit_json(f, "rng.json", put("ranks", [])), "ranks is empty"),
    ("manifest-step", lambda f: edit_json(f, "manifest.json", put("step", 2), forge=False), "named for step 4"),
    ("manifest-escapes", lambda f: edit_json(f, "manifest.json", lambda m: m["files"].update(
        {"../../x": m["files"]["rng.json"]}), forge=False), "only plain file names"),
    ("no-sharding-entry", lambda f: edit_header(f, sharding(lambda i: i.pop(WPE))), "lacks ['" + WPE),
    ("sharding-not-json", lambda f: edit_header(f, put("__metadata__.DCP_SHARDING_INFO", "{oops")), "is not JSON"),
    ("chunk-outside", lambda f: edit_header(f, sharding(put((WPE, "saved_offsets"), [1, 0]))), "reaches outside"),
    ("int-dtype", lambda f: edit_header(f, lambda h: h[WPE].update(dtype="I32")), "is I32"),
    ("huge-header", lambda f: (sorted(f.glob("*.safetensors"))[0].write_bytes(struct.pack("<Q", 1 << 40) + b"{}"),
                               forge_manifest(f)), "header claims"),
    ("state-symlink", lambda f: ((f / "state.json").rename(f.parent.parent / "elsewhere.json"),
                                 (f / "state.json").symlink_to(f.parent.parent / "elsewhere.json")),
     "state.json is a symbolic link"),
]


@pytest.mark.parametrize("tamper,words", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_tampered_checkpoint_is_passed_over_with_one_warning(run, tamper, words):
    tamper(step_folder(run, 4))
    chosen, warnings = choose(run)
    assert chosen == "step00000002" and len(warnings) == 1, warnings
    assert "step00000004" in warnings[0] and words in warnings[0], warnings[0]


def test_a_misnamed_copy_is_passed_over(run):
    """A copy of step 2 named as a later step: its name is not the step it holds."""
    shutil.copytree(step_folder(run, 2), step_folder(run, 99))
    chosen, warnings = choose(run)
    assert chosen == "step00000004" and len(warnings) == 1 and "named for step 99" in warnings[0]


def test_retention_never_counts_folders_named_for_later_steps(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (1, 2, 3, 99):
        (root / files.step_tag(step)).mkdir(parents=True)
    assert files.prune(root, keep=2, keep_every=0, saved=3) == ["step00000001"]
    assert sorted(p.name for p in root.iterdir()) == ["step00000002", "step00000003", "step00000099"]


def resumed(run_dir: Path, corpus, *overrides, steps: int = 4) -> tuple[list[str], str]:
    proc = train(run_dir, corpus, *RUN, f"train.max_steps={steps}", *overrides)
    assert "Traceback" not in proc.stderr
    return [line for line in proc.stderr.splitlines() if line.startswith("gpt3d: warning:")], proc.stdout


EVERY_CASE_STEPS = 2 * (len(CASES) + 1)  # a checkpoint every 2 steps: step 2 intact, case k at step 2k + 4
KEEP_EVERY_CASE = f"train.keep_checkpoints={len(CASES) + 1}"


@pytest.fixture(scope="module")
def one_checkpoint_per_case(tmp_path_factory, corpus):
    """A run with one checkpoint per case, plus step 2, which stays intact."""
    run_dir = tmp_path_factory.mktemp("tamper-every-case") / "run"
    train(run_dir, corpus, *RUN, f"train.max_steps={EVERY_CASE_STEPS}", KEEP_EVERY_CASE)
    return run_dir


def test_every_tampered_checkpoint_is_passed_over_through_the_cli(one_checkpoint_per_case, tmp_path, corpus):
    """Through the CLI, every case at once: each tampered checkpoint (newest first) is passed over with
    its one warning naming the folder and the fault, the run resumes from the intact step 2 and logs
    steps 3 onwards exactly as the run that never stopped logged them (so nothing of a rejected
    checkpoint's schedule, batch or state is used), and its saves replace the tampered folders."""
    trained = one_checkpoint_per_case
    run = Path(shutil.copytree(trained, tmp_path / "run", symlinks=True))
    expected = {}
    for k, (name, tamper, words) in enumerate(CASES):
        step = 2 * k + 4
        tamper(step_folder(run, step))
        expected[files.step_tag(step)] = (name, words.replace("named for step 4", f"named for step {step}"))
    linked_to = (run / "elsewhere.json").read_bytes()
    warnings, stdout = resumed(run, corpus, KEEP_EVERY_CASE, steps=EVERY_CASE_STEPS)
    assert len(warnings) == len(CASES), warnings
    for warning, (tag, (name, words)) in zip(warnings, sorted(expected.items(), reverse=True)):
        assert f"{tag} is damaged or incomplete" in warning and words in warning, (name, warning)
    assert "step00000002 at step 2" in stdout
    assert [[r[k] for k in KEYS] for r in metrics(run)] == [[r[k] for k in KEYS] for r in metrics(trained)]
    assert checkpoint.select(run / "checkpoints", warn=pytest.fail)[0].name == files.step_tag(EVERY_CASE_STEPS)  # saved anew
    assert (run / "elsewhere.json").read_bytes() == linked_to  # what the state-symlink case pointed at: only read


def test_a_misnamed_copy_never_displaces_a_real_checkpoint(run, corpus, trained):
    """step 4 renamed step 99 (and `latest` pointed at it): passed over (the run resumes at step 2 and logs steps 3 and 4 as the run
    that never stopped), and retention, keeping two, keeps step 2 beside the new step 4."""
    step_folder(run, 4).rename(step_folder(run, 99))
    (run / "checkpoints" / "latest").write_text("step00000099\n")
    warnings, stdout = resumed(run, corpus, "train.keep_checkpoints=2")
    assert len(warnings) == 1 and "named for step 99" in warnings[0] and "step00000002 at step 2" in stdout
    assert [[r[k] for k in KEYS] for r in metrics(run)] == [[r[k] for k in KEYS] for r in metrics(trained)]
    assert sorted(p.name for p in (run / "checkpoints").glob("step*")) == ["step00000002", "step00000004",
                                                                          "step00000099"]


def test_a_step_folder_linked_elsewhere_is_never_followed(run, corpus, tmp_path, trained):
    """step 4 replaced by a link to another run's checkpoint: passed over, and the next save replaces
    the link, leaving what it pointed to untouched."""
    other = Path(shutil.copytree(step_folder(trained, 4), tmp_path / "other-run" / "step00000004"))
    before = {p.name: p.read_bytes() for p in other.iterdir()}
    shutil.rmtree(step_folder(run, 4))
    step_folder(run, 4).symlink_to(other, target_is_directory=True)
    warnings, stdout = resumed(run, corpus)
    assert len(warnings) == 1 and "symbolic link" in warnings[0] and "step00000002 at step 2" in stdout
    assert not step_folder(run, 4).is_symlink()
    assert {p.name: p.read_bytes() for p in other.iterdir()} == before
    assert [[r[k] for k in KEYS] for r in metrics(run)] == [[r[k] for k in KEYS] for r in metrics(trained)]


def test_the_only_checkpoint_tampered_is_one_line_and_writes_nothing(run, corpus):
    shutil.rmtree(step_folder(run, 2))
    edit_json(step_folder(run, 4), "state.json", put("step", -5))
    listing = sorted(str(p) for p in run.rglob("*"))
    proc = train(run, corpus, *RUN, "train.max_steps=6", check=False)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("gpt3d: error:")]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert len(errors) == 1 and "state.json: step=-5" in errors[0]
    assert sorted(str(p) for p in run.rglob("*")) == listing


def test_a_weights_only_checkpoint_reads_back_but_is_never_resumed(run):
    """A checkpoint whose state.json has no data position, LR schedule or schedule record (as a tool that
    registers only progress and counters writes it) is intact, so its weights read back (the newest is
    chosen, no warning); a resume from it is one error naming what it lacks, before anything is built."""
    from model import GPTConfig
    from train.checkpoint import CheckpointError
    from train.checkpoint.resume_point import resume_point

    edit_json(step_folder(run, 4), "state.json", lambda doc: [doc.pop(key) for key in ("data", "lr_scheduler", "extra")])
    assert choose(run) == ("step00000004", [])
    saved = json.loads((step_folder(run, 4) / "state.json").read_text())["model"]
    with pytest.raises(CheckpointError, match=r"holds weights but no run to resume .*\['data', 'extra', 'lr_scheduler'\]"):
        resume_point(str(run), run, GPTConfig.from_dict(saved))


# ---------------------------------------------------------------------------------------------
# export targets and train.init_from


def test_export_refuses_links_and_checkpoint_folders(trained, tmp_path, capsys):
    from train.export import main

    empty = tmp_path / "empty"
    empty.mkdir()
    (tmp_path / "to-empty").symlink_to(empty)
    (tmp_path / "dangling").symlink_to(tmp_path / "nothing")
    targets = {"to-empty": "symbolic link", "dangling": "symbolic link"}
    for name, words in targets.items():
        assert main([str(trained / "checkpoints"), str(tmp_path / name)]) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and words in err
    inside = shutil.copytree(trained, tmp_path / "run")
    for target in (inside / "checkpoints" / "step00000009", inside / "checkpoints" / "hf"):
        assert main([str(inside / "checkpoints"), str(target)]) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and "inside a checkpoints folder" in err
        assert not target.exists()
    assert not list(empty.iterdir()) and not (tmp_path / "nothing").exists()


TOY = dict(n_layer=2, n_head=2, d_model=16, d_ff=64, seq_len=16)


def hf_folder(folder: Path, tensors=None, config=None) -> Path:
    """A Hugging Face GPT-2 folder of the TOY model (zero weights), optionally altered."""
    import torch
    from safetensors.torch import save_file

    from model import GPTConfig
    from parallel.naming import full_shapes
    from train.checkpoint.hugging_face import gpt2_config, to_gpt2

    cfg = GPTConfig(**TOY)
    weights = to_gpt2({n: torch.zeros(s) for n, s in full_shapes(cfg).items()}, cfg)
    if tensors:
        tensors(weights)
    folder.mkdir()
    save_file(weights, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config if config is not None else gpt2_config(cfg)))
    return folder


@pytest.mark.parametrize("tensors,config,words", [
    (None, [1, 2], "holds a list"),
    (None, {"model_type": "gpt2", "n_layer": "2"}, "n_layer='2'"),
    (lambda w: w.pop("transformer.wpe.weight"), None, "has no tensor 'transformer.wpe.weight'"),
    (lambda w: w.update({"transformer.wpe.weight": w["transformer.wpe.weight"][:8]}), None,
     "transformer.wpe.weight is"),
    (lambda w: w.update({"transformer.ln_f.bias": w["transformer.ln_f.bias"].long()}), None, "I64"),
], ids=["config-list", "config-type", "missing-tensor", "wrong-shape", "int-tensor"])
def test_init_from_refuses_bad_folders_in_one_line(tmp_path, tensors, config, words):
    from model import GPTConfig
    from train.checkpoint.hugging_face import ExportError, check_init_from

    folder = hf_folder(tmp_path / "hf", tensors, config)
    with pytest.raises(ExportError) as err:
        check_init_from(folder, GPTConfig(**TOY))
    assert words in str(err.value) and "\n" not in str(err.value)


def test_init_from_a_bad_folder_is_one_line_through_the_cli(tmp_path, corpus):
    folder = hf_folder(tmp_path / "hf", config=[1, 2])
    proc = train(tmp_path / "run", corpus, f"train.init_from={folder}", check=False)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("gpt3d: error:")]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and len(errors) == 1
    assert "config.json: holds a list" in errors[0] and not (tmp_path / "run").exists()


def test_init_from_refuses_a_huge_header(tmp_path):
    from model import GPTConfig
    from train.checkpoint.hugging_face import ExportError, check_init_from

    folder = hf_folder(tmp_path / "hf")
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", 1 << 50) + b"{}")
    with pytest.raises(ExportError, match="header claims"):
        check_init_from(folder, GPTConfig(**TOY))


def test_an_intact_hf_folder_passes(tmp_path):
    from model import GPTConfig
    from train.checkpoint.hugging_face import check_init_from

    check_init_from(hf_folder(tmp_path / "hf"), GPTConfig(**TOY))
