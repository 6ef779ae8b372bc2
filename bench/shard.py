"""One tensor-parallel rank's share of one transformer block, timed against the planner's prediction.

  python -m bench.shard model=gpt3-175b parallel.tp=8                      # micro batch 1, T = seq_len
  python -m bench.shard model=gpt3-13b parallel.tp=2 train.micro_batch_size=2 parallel.sequence_parallel=true
  python -m bench.shard model=gpt3-175b parallel.tp=8 train.precision=fp8  # bf16, fp8 tensorwise and rowwise
  python -m bench.shard model=toy parallel.tp=2 bench.iterations=3         # a CPU smoke run

The block is the model's first one (layer 1 of the flat list, model/gpt.make_layer), sharded by
the project's own tensor-parallel plan (parallel.tensor.shard_layer) as rank 0 of a *fake* process
group of tp ranks (torch's "fake" backend, as the planner's dry run uses): every collective the
shard issues (all-reduce, or under sequence parallelism all-gather and reduce-scatter) is a local
no-op on a tensor of the shape the real one has. The fake backend leaves a gathered or scattered
output uninitialised; the bench fills it with copies of the rank's own input (`defined_outputs`),
so no stray NaN or denormal enters the math and slows it (on a CPU, a 200× slowdown). So the shard
runs alone on one device with exactly the work of one rank: d_model-wide LayerNorms and residual adds (1/tp of the sequence under
sequence parallelism), n_head/tp heads, d_ff/tp of the MLP, on micro batch × seq_len tokens.

Each iteration is the block's forward and backward (a gradient of ones-shaped random values into
its output, parameter gradients accumulated as training does). Precision as training runs it:
train.precision (auto: bf16 on CUDA, fp32 on a CPU); bf16 casts the block's weights to bf16,
autocast runs fp32 weights under torch.autocast. Timed after bench.warmup iterations, over
bench.iterations: on CUDA with events around each iteration (the median), on a CPU wall time (the
minimum). Printed next to it: the planner's prediction for the same block, rank and micro batch
(train.planner.estimate.block_seconds, communication left out) on plan.hardware (on CUDA: the
visible GPU's preset), and the ratio measured / predicted.

train.precision=fp8 times three blocks of the same weights, one after the other (each freed before the
next): bf16, then fp8 tensorwise and fp8 rowwise, each fp8 block's linears in float8 as the run would choose
them (train/planner/fp8_rule.py at this tp and micro batch on this GPU, or train.fp8_linears; the choice is
printed), and says each fp8 block's speed against bf16's. The blocks compile as a run's would under fp8
(train.runtime.precision.fp8_compile: on a GPU unless model.compile=false is given), the bf16 block alike,
so the ratio compares like with like; on the CPU the float8 products are emulated and nothing compiles.
"""

from __future__ import annotations

import contextlib
import statistics
import sys

import torch

from bench.timing import call_seconds
from model import GPTConfig
from train.config.entry import EXIT_BAD_INPUT
from train.config.sections import TrainConfig

BENCH_DEFAULTS = {"iterations": 10, "warmup": 3, "seed": 0}  # bench.* overrides


def _split(argv: list[str]) -> tuple[list[str], dict]:
    """The Hydra overrides, and the bench.* ones (iterations, warmup, seed) as integers."""
    options, overrides = dict(BENCH_DEFAULTS), []
    for arg in argv:
        key, _, value = arg.partition("=")
        if key.startswith("bench."):
            name = key.removeprefix("bench.")
            if name not in BENCH_DEFAULTS or not value.isdigit() or (name == "iterations" and int(value) < 1):
                raise ValueError(f"{arg!r}: bench options are {sorted(BENCH_DEFAULTS)}, each a non-negative integer "
                                 f"(iterations ≥ 1)")
            options[name] = int(value)
        else:
            overrides.append(arg)
    return overrides, options


@contextlib.contextmanager
def fake_tensor_parallel_rank(tp: int):
    """This process as rank 0 of a fake world of tp processes (collectives do nothing); the topology."""
    from parallel.topology import Topology
    from train.planner.dry_run import _fake_world
    from parallel.topology import skip_shared_memory_op

    skip_shared_memory_op()  # DeepSpeed would compile an op the shard never calls
    with _fake_world(0, tp), defined_outputs():
        yield Topology.create(tp, 1)


@contextlib.contextmanager
def defined_outputs():
    """The fake backend's gathers and scatters, their outputs filled from this rank's input."""
    import torch.distributed as dist

    originals = {name: getattr(dist, name) for name in ("all_gather", "all_gather_into_tensor", "reduce_scatter",
                                                         "reduce_scatter_tensor")}

    def all_gather(tensors, tensor, *args, **kwargs):
        work = originals["all_gather"](tensors, tensor, *args, **kwargs)
        for t in tensors:
            t.copy_(tensor)
        return work

    def all_gather_into_tensor(output, tensor, *args, **kwargs):
        work = originals["all_gather_into_tensor"](output, tensor, *args, **kwargs)
        output.view(-1, tensor.numel()).copy_(tensor.reshape(1, -1))  # (p, numel) ← each piece
        return work

    def reduce_scatter(output, tensors, *args, **kwargs):
        work = originals["reduce_scatter"](output, tensors, *args, **kwargs)
        output.copy_(tensors[0])
        return work

    def reduce_scatter_tensor(output, tensor, *args, **kwargs):
        work = originals["reduce_scatter_tensor"](output, tensor, *args, **kwargs)
        output.copy_(tensor.reshape(-1)[: output.numel()].view_as(output))
        return work

    replacements = {"all_gather": all_gather, "all_gather_into_tensor": all_gather_into_tensor,
                    "reduce_scatter": reduce_scatter, "reduce_scatter_tensor": reduce_scatter_tensor}
    for name, function in replacements.items():
        setattr(dist, name, function)
    try:
        yield
    finally:
        for name, function in originals.items():
            setattr(dist, name, function)


def build_block_shard(model_cfg: GPTConfig, topology, sequence_parallel: bool, device: torch.device,
                      modes=None) -> torch.nn.Module:
    """Rank 0's shard of the model's first block on `device`, built in `modes` (model.modes.LayerModes: which
    linears compute in float8; None: the defaults), with small random weights (the same for every build)."""
    from model.gpt import make_layer
    from model.init import materialize_
    from model.modes import LayerModes
    from parallel.tensor import TP_PLAN, shard_layer

    with torch.device("meta"):
        block = make_layer(model_cfg, 1, modes or LayerModes())
    shard_layer(block, topology, TP_PLAN, sequence_parallel, 1)
    materialize_(block, device)
    generator = torch.Generator(device="cpu").manual_seed(0)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(0.02 * torch.randn(p.shape, generator=generator))
    return block


def precision_of(train: TrainConfig, device: torch.device) -> str:
    precision = train.precision
    return ("bf16" if device.type == "cuda" else "fp32") if precision == "auto" else precision


def time_block(block, micro_batch: int, tokens: int, d_model: int, precision: str, device: torch.device,
               iterations: int, warmup: int, seed: int) -> float:
    """Seconds of one forward + backward of `block` on (micro_batch, tokens, d_model) inputs."""
    dtype = torch.bfloat16 if precision in ("bf16", "fp8") else torch.float32
    block.to(dtype)
    generator = torch.Generator(device="cpu").manual_seed(seed)
    h = torch.randn(micro_batch, tokens, d_model, generator=generator).to(device, dtype).requires_grad_()  # (b, T/σ, d)
    grad = torch.randn(h.shape, generator=generator).to(device, dtype)  # (b, T/σ, d)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "autocast")

    def step():
        with autocast:
            out = block(h)  # (b, T/σ, d)
        out.backward(grad)

    seconds = call_seconds(step, device, iterations, warmup)
    return statistics.median(seconds) if device.type == "cuda" else min(seconds)


def run(argv: list[str], out=sys.stdout, err=sys.stderr) -> int:
    from omegaconf import OmegaConf

    from model.modes import Float8, LayerModes
    from train.config.sections import Sections
    from train.config.sections.train import FP8_RECIPES
    from train.plan import compose
    from train.planner.estimate import Layout, block_seconds, for_precision
    from train.planner.fp8_rule import choice_for
    from train.planner.from_config import hardware_from_config
    from train.planner.hardware import for_cuda_device
    from train.run.checks import check_model
    from train.runtime.precision import fp8_compile, fp8_refusal

    with contextlib.redirect_stdout(err):  # DeepSpeed announces its accelerator on import
        import deepspeed.runtime.utils  # noqa: F401
    try:
        overrides, options = _split(argv)
        cfg = compose(overrides)
        sections, model_cfg = Sections.of(cfg), check_model(OmegaConf.to_container(cfg.model, resolve=True))
        parallel, train = sections.parallel, sections.train
        tp, sp, micro = parallel.tp, parallel.sequence_parallel, train.micro_batch_size
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        precision = precision_of(train, device)
        if precision == "fp8" and fp8_refusal(device) is not None:
            raise ValueError(fp8_refusal(device))
        # fp8: bf16 and each recipe beside it, compiled alike as a run under fp8 would be
        rows = [("bf16", None), *(("fp8", recipe) for recipe in FP8_RECIPES)] if precision == "fp8" else [(precision, None)]
        given = any(o.lstrip("+").split("=", 1)[0] == "model.compile" for o in overrides)
        compiled, blocks_words = fp8_compile(precision, model_cfg.compile, given, device)
        hardware = for_cuda_device() if device.type == "cuda" else hardware_from_config(OmegaConf.to_object(cfg.plan))
        from parallel.topology import check_layout

        check_layout(model_cfg.n_head, model_cfg.d_ff, tp, 1, model_cfg.n_layer, tp)
        if sp and model_cfg.seq_len % tp:
            raise ValueError(f"parallel.sequence_parallel=true needs model.seq_len={model_cfg.seq_len} divisible by tp={tp}")
    except Exception as error:  # Hydra's and the checks' messages name the bad value
        print(f"gpt3d bench.shard: error: {'; '.join(str(error).splitlines()[:2])}", file=err)
        return EXIT_BAD_INPUT
    layout = Layout(tp, 1, 1, micro, micro, sequence_parallel=sp)
    heads = model_cfg.n_head // tp
    print(f"{model_cfg.name}: one block, tensor-parallel rank 0 of {tp}{' with sequence parallelism' if sp else ''}: "
          f"d_model {model_cfg.d_model}, {heads} of {model_cfg.n_head} heads, d_ff {model_cfg.d_ff // tp} of "
          f"{model_cfg.d_ff}, micro batch {micro} × T {model_cfg.seq_len}, {precision} on "
          f"{torch.cuda.get_device_name() if device.type == 'cuda' else 'CPU'}{', compiled' if compiled else ''}",
          file=out)
    if blocks_words:
        print(blocks_words, file=out)
    bf16_s = None
    for name, recipe in rows:
        modes, implementation = LayerModes(), for_precision(name, compiled=compiled)
        if recipe is not None:
            choice = choice_for(model_cfg, tp, micro, recipe, train.fp8_linears, hardware.preset or None)
            modes = LayerModes(fp8=Float8(recipe, emulate=device.type != "cuda"), fp8_linears=frozenset(choice.linears))
            implementation = for_precision("fp8", fp8_recipe=recipe, compiled=compiled, fp8_linears=choice.linears)
            print(choice.line(), file=out)
        predicted = block_seconds(model_cfg, layout, implementation, hardware)
        with fake_tensor_parallel_rank(tp) as topology:
            block = build_block_shard(model_cfg, topology, sp, device, modes)
            if compiled:
                block.compile()
            tokens = model_cfg.seq_len // tp if sp else model_cfg.seq_len
            measured = time_block(block, micro, tokens, model_cfg.d_model, name, device, options["iterations"],
                                  options["warmup"], options["seed"])
        del block
        if device.type == "cuda":
            torch.cuda.empty_cache()
        label = f"{name} {recipe}" if recipe else name
        against = f", {bf16_s / measured:.2f}× bf16's speed" if recipe is not None and bf16_s else ""
        bf16_s = measured if name == "bf16" else bf16_s
        print(f"forward + backward per block{'' if len(rows) == 1 else ', ' + label}: measured {measured * 1e3:.3f} ms, "
              f"predicted {predicted * 1e3:.3f} ms ({hardware.name}), measured / predicted {measured / predicted:.2f}"
              f"{against}", file=out)
    return 0


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
