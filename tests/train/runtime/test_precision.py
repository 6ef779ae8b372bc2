"""train.precision=bf16: bf16 compute weights, fp32 masters and moments in the optimizer, checkpoints
of the fp32 masters, exact resume; fp8 refused where it cannot run (its runs: tests/end_to_end/test_fp8.py).

Gloo ranks build the real run (train.run.build.build from the composed config) and step it on fixed
windows. References: the fp32 run of the same windows (losses within bf16's precision), the gradient
computed by plain autograd on the same bf16 weights (norm, clipping), DeepSpeed's own flat fp32
partition behind each parameter (the masters a checkpoint must hold), and the run that never stopped
(resume).
"""

from __future__ import annotations

import math

import pytest
import torch
from checkpoint_state import load_folder, save_checkpoint
from cli import TINY
from distributed import run_distributed

from train.run.spec import resolve

MODEL = [o for o in TINY if not o.startswith("data") and not o.startswith("model.n_layer")] + [
    "model.n_layer=2", "train.global_batch_size=2", "train.micro_batch_size=1", "train.eval_interval=0",
    "logging.wandb.mode=disabled", "train.sample_tokens=0", "train.device=cpu", "data.streams=1",
]
CLIP = 0.5  # optim.grad_clip: below the toy's gradient norm (≈ 2–3), so clipping acts
# bf16 keeps 8 significant bits (relative rounding 2^-9 ≈ 0.2%); over 4 steps of the toy the loss
# stays within 1% of the fp32 run's
BF16_LOSS_RTOL = 1e-2
# The engine's bf16 gradient and autograd's on the same weights may round apart by one bf16 step
# (2^-8 relative) in single elements; a missing accumulation, clip or norm term is off by far more
BF16_GRAD_RTOL = 2**-7


def compose(corpus: str, overrides: list[str]):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from train.config.entry import CONFIG_DIR, register_config

    register_config()
    with initialize_config_dir(version_base=None, config_dir=str(CONFIG_DIR), job_name="test"):
        return hydra_compose("config", overrides=[*MODEL, "data=files", f"data.paths=[{corpus}/*.txt]",
                                                  f"optim.grad_clip={CLIP}", *overrides])


def windows(seed: int) -> torch.Tensor:
    """A global batch of 2 windows (2, T + 1) of random token ids."""
    return torch.randint(0, 50257, (2, 33), generator=torch.Generator().manual_seed(seed))


def masters(trainer) -> dict[str, torch.Tensor]:
    """{name: DeepSpeed's fp32 master of the parameter}: its fragment of the optimizer's flat partition."""
    return {name: p._hp_mapping.get_hp_fragment().detach().clone().reshape(p.shape)
            for name, p in trainer.engine.module.named_parameters()}


def autograd_gradient(trainer, batch: torch.Tensor) -> dict[str, torch.Tensor]:
    """The step's gradient by plain autograd on the module's bf16 weights, without touching .grad:
    each micro batch's loss / (micro batches), its bf16 gradient summed in fp32."""
    module = trainer.engine.module
    names, params = zip(*module.named_parameters())
    total = {name: torch.zeros(p.shape) for name, p in zip(names, params)}
    micro = batch.split(1)
    for m in micro:
        loss = module(m[:, :-1], m[:, 1:]) / len(micro)
        for name, g in zip(names, torch.autograd.grad(loss, params)):
            total[name] += g.float()
    return total


def fp32_worker(corpus: str, run_dir: str) -> list[float]:
    from train.run.build import build

    trainer = build(resolve(compose(corpus, ["train.precision=fp32"]), run_dir))
    return [float(trainer.step(windows(seed)).loss) for seed in range(4)]


def bf16_worker(corpus: str, run_dir: str) -> dict:
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer

    from train.checkpoint.optimizer_state import ParameterState
    from train.run.build import build

    trainer = build(resolve(compose(corpus, ["train.precision=bf16"]), run_dir))
    engine, module = trainer.engine, trainer.engine.module
    assert isinstance(engine.optimizer, BF16_Optimizer)
    assert {p.dtype for p in module.parameters()} == {torch.bfloat16}
    flat = [p for group in engine.optimizer.optimizer.param_groups for p in group["params"]]
    assert {p.dtype for p in flat} == {torch.float32}
    assert sum(p.numel() for p in flat) >= sum(p.numel() for p in module.parameters())

    # a non-finite gradient: the step is skipped, nothing moves
    before = masters(trainer)
    handle = module.get_parameter("layers.1.attn.qkv.weight").register_hook(lambda g: g * math.nan)
    skipped = trainer.step(windows(100))
    handle.remove()
    # decided on the device (fused AdamW's found_inf): the step reports its flag, which the loop counts when it
    # reads it (train/guard/safeguards.py); the engine, told nothing, counts nothing
    assert float(skipped.skipped) == 1.0 and engine.skipped_steps == 0
    assert all(torch.equal(before[k], v) for k, v in masters(trainer).items())
    for state in engine.optimizer.optimizer.state.values():  # moments as before any step: zeros, step count 0
        assert float(state["step"]) == 0 and not state["exp_avg"].any() and not state["exp_avg_sq"].any()

    # losses, the gradient norm and clipping against autograd on the same bf16 weights
    losses, norm_pairs, first_moments = [], [], None
    for seed in range(4):
        batch = windows(seed)
        reference = autograd_gradient(trainer, batch)
        result = trainer.step(batch)
        assert float(result.skipped) == 0.0
        losses.append(float(result.loss))
        norm = math.sqrt(sum(float(g.double().square().sum()) for g in reference.values()))
        norm_pairs.append((result.grad_norm, norm))
        if seed == 0:  # AdamW's first step: exp_avg = (1 − β1) · clipped gradient
            state = ParameterState(engine)
            scale = min(1.0, CLIP / (norm + 1e-6))
            first_moments = [(state.get(p)["exp_avg"], 0.1 * scale * reference[name])
                             for name, p in module.named_parameters()]
        current = masters(trainer)  # the bf16 weights are the masters rounded, after every update
        assert all(torch.equal(p.detach(), current[name].bfloat16()) for name, p in module.named_parameters())
        if seed == 1:
            save_checkpoint(trainer)
            at_save = current
    return {"losses": losses, "norms": norm_pairs, "first_moments": first_moments, "at_save": at_save,
            "final": masters(trainer)}


def resume_worker(corpus: str, run_dir: str) -> dict:
    from train.run.build import build

    trainer = build(resolve(compose(corpus, ["train.precision=bf16", f"train.resume={run_dir}"]),
                                 run_dir + "-resumed"))
    assert trainer.checkpointer.restore()
    losses = [float(trainer.step(windows(seed)).loss) for seed in (2, 3)]
    return {"losses": losses, "final": masters(trainer)}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from cli import write_corpus

    return write_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def bf16_run(tmp_path_factory, corpus):
    run_dir = tmp_path_factory.mktemp("bf16")
    return run_dir, run_distributed(bf16_worker, 1, str(corpus), str(run_dir), timeout=600)[0]


def test_bf16_losses_follow_the_fp32_run(tmp_path, corpus, bf16_run):
    fp32 = run_distributed(fp32_worker, 1, str(corpus), str(tmp_path), timeout=600)[0]
    bf16 = bf16_run[1]["losses"]
    assert bf16 != fp32  # the runs did compute in different precisions
    assert bf16 == pytest.approx(fp32, rel=BF16_LOSS_RTOL)


def test_bf16_gradient_norm_and_clipping_match_autograd(bf16_run):
    result = bf16_run[1]
    for got, expected in result["norms"]:
        assert got == pytest.approx(expected, rel=1e-3)
    assert result["norms"][0][1] > CLIP  # clipping acted
    for got, expected in result["first_moments"]:
        torch.testing.assert_close(got, expected, rtol=BF16_GRAD_RTOL, atol=BF16_GRAD_RTOL * expected.abs().max().item())


def test_bf16_checkpoint_holds_the_fp32_masters_and_resumes_bit_for_bit(bf16_run, corpus):
    run_dir, result = bf16_run
    folders = sorted((run_dir / "checkpoints").glob("step*"))
    assert len(folders) == 1
    tensors = {k: v for f, content in load_folder(folders[0]).items() if f.endswith(".safetensors")
               for k, v in content.items()}
    saved = {k.removeprefix("model/"): v for k, v in tensors.items() if k.startswith("model/")}
    assert saved.keys() == result["at_save"].keys()
    for name, master in result["at_save"].items():
        rows = saved[name].shape[0]  # the padded vocabulary's master has zero rows beyond V (model/vocab.py)
        assert saved[name].dtype == torch.float32 and torch.equal(saved[name], master[:rows]), name
        assert not master[rows:].any(), name
    # more than bf16's bits were kept
    assert any(not torch.equal(v, v.bfloat16().float()) for v in saved.values())
    resumed = run_distributed(resume_worker, 1, str(corpus), str(run_dir), timeout=600)[0]
    assert resumed["losses"] == result["losses"][2:]
    assert all(torch.equal(resumed["final"][k], v) for k, v in result["final"].items())


def test_fp8_runs_on_the_cpu_and_is_refused_before_ada_in_one_line_naming_bf16(monkeypatch):
    """Checked before anything is built (a ConfigError: the command exits 2): compute capability ≥ 8.9
    on CUDA (a GPU is faked here: the check reads only its capability and name); the CPU runs it."""
    from config_checks import refusal

    from train.config.sections.train import TrainConfig
    from train.runtime.precision import check_fp8

    assert refusal(["train.precision=fp8"]) is None  # on this CPU: runs
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    fp8 = TrainConfig(precision="fp8")
    for capability, refused in (((8, 0), True), ((8, 6), True), ((8, 9), False), ((9, 0), False)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        if not refused:
            check_fp8(fp8, torch.device("cuda"))
            continue
        with pytest.raises(ValueError) as error:
            check_fp8(fp8, torch.device("cuda"))
        assert str(error.value) == (
            "train.precision=fp8: must run on compute capability ≥ 8.9 (float8 tensor cores: Ada, Hopper or newer); "
            f"NVIDIA A100-SXM4-80GB has {capability[0]}.{capability[1]}: use train.precision=bf16")
    assert refusal(["train.precision=bf32"]).startswith("train.precision='bf32': must be one of ['auto', 'fp32', 'autocast'")
    assert refusal(["train.fp8_recipe=blockwise"]).startswith("train.fp8_recipe='blockwise': must be one of "
                                                              "['tensorwise', 'rowwise']")


def test_fp8_without_torchao_is_refused_in_one_line(monkeypatch):
    import importlib.util

    from config_checks import refusal

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real(name, *a))
    assert refusal(["train.precision=fp8"]) == ("train.precision=fp8: needs torchao for its float8 casts and products: "
                                                "pip install -e '.[fp8]'; or use train.precision=bf16")
    assert refusal(["train.precision=bf16"]) is None  # only fp8 needs it


@pytest.mark.parametrize("precision, compile_, given, device, compiled, words", [
    ("bf16", False, False, "cuda", False, ""),  # only fp8 changes model.compile
    ("fp8", True, True, "cpu", True, "blocks compiled (model.compile=true)"),
    ("fp8", False, True, None, False, "blocks eager: model.compile=false was given"),
    ("fp8", False, False, "cpu", False, "blocks eager: on cpu the float8 products are emulated"),
    ("fp8", False, False, None, True, "blocks compiled (fp8 compiles them where it can"),  # the planner's GPU
    ("fp8", False, False, "cuda", True, "blocks compiled (fp8 compiles them where it can"),  # the probe passes
    ("fp8", False, False, "cuda:1", False, "blocks eager: torch.compile is unavailable on cuda:1 (no Triton)"),
], ids=["bf16", "compile-given", "compile-false-given", "cpu", "planner", "cuda", "cuda-probe-fails"])
def test_fp8_compiles_the_blocks_where_it_can_and_says_why_not(monkeypatch, precision, compile_, given, device,
                                                              compiled, words):
    """fp8 without model.compile given: compiled wherever that can work; the CUDA probe faked (it compiles a
    function on the device), failing on cuda:1."""
    import model.compile
    from train.runtime.precision import fp8_compile

    monkeypatch.setattr(model.compile, "compile_unavailable", lambda d: "no Triton" if str(d) == "cuda:1" else None)
    got = fp8_compile(precision, compile_, given, None if device is None else torch.device(device))
    assert got[0] == compiled and got[1].startswith(words)
