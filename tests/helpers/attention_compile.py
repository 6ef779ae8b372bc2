"""Ahead-of-time compilation of the attention kernels for NVIDIA GPUs, on a machine without one.

`triton.compile` with a `GPUTarget` runs Triton's whole pipeline (Triton IR → PTX → ptxas → cubin)
for a chosen architecture with no GPU present. Each kernel is compiled the way the runtime would
compile it for contiguous or packed-QKV inputs (pointers and strides specialised as multiples of
16; T, lo, hi never specialised, as the kernels declare), in bf16 (what training runs: no precision of
the trainer feeds the kernel fp16, whose results the interpreter tests check): for sm_90 (Hopper, whose
tensor cores need `wgmma`) every autotune config at the head dims it serves and TABLE's choices at
each head dim, for sm_80 TABLE's choices. The kernels are those of both backwards: the
default one (preprocess zeroing the dQ accumulator, then dK, dV and atomic dQ adds) and the
deterministic one (preprocess, dK and dV alone, then the dQ pass). From each binary it reads the
per-thread register count and stack frame (cuobjdump's resource usage: a non-zero STACK is where
ptxas put spilled registers, since these kernels call nothing and keep no local arrays) and counts
the `wgmma` instructions, the Ampere-style `mma.sync` ones (a product Triton could not make a wgmma
on sm_90), the atomic instructions (`atom.`, `red.`) and the Hopper bulk-tensor loads
(`cp.async.bulk.tensor`, TMA) in the PTX. sm_90 is compiled on the kernels' Hopper path (HOPPER: TMA
tensor descriptors, the transposed dQ product), sm_80 on the other, as `_hopper_path` picks at run time.

  python tests/helpers/attention_compile.py          # the table, with TRITON_INTERPRET unset
  python tests/helpers/attention_compile.py --json   # one JSON record per compiled kernel
  python tests/helpers/attention_compile.py --prune  # the configuration space for sm_90: SWEEP

Compiles run in parallel, one process per CPU, and land in Triton's on-disk cache
(~/.triton/cache), so a second run takes seconds. tests/model/test_attention_compile.py runs this in a
subprocess: the interpreter tests set TRITON_INTERPRET=1 for the whole pytest process.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository, when run as a script

from model.attention_configs import KERNELS, candidates, space, table_entries  # noqa: E402

HEAD_DIMS = (64, 80, 96, 128)
DTYPES = ("bf16",)  # what training runs
ARCHS = (80, 90)
# Every autotune candidate is compiled for the GPU the kernels are tuned for; on sm_80 TABLE's choices only
# (what GPT3D_TRITON_AUTOTUNE=0 runs; an autotuned A100 run times its candidates and keeps the fastest).
TUNED_ARCH = 90
# Pointer arguments and their element types ("in" = the input dtype); every other non-constexpr
# argument is an int32 except these float32 scalars. Strides are the int arguments named s…
# DQ is the float32 accumulator, except in the deterministic dQ pass (`kernels` overrides it).
POINTERS = {"Q": "in", "K": "in", "V": "in", "Out": "in", "DO": "in", "DK": "in", "DV": "in",
            "LSE": "fp32", "DELTA": "fp32", "DQ": "fp32"}
FLOATS = ("qk_scale", "sm_scale")
# PTX instructions counted per kernel: an atomic read-modify-write (atom.*, or red.* when the old
# value is unused), and a TMA bulk-tensor copy.
ATOMIC_RE = re.compile(r"^\s*(?:@!?%\w+\s+)?(?:atom|red)\.", re.MULTILINE)


def kernels():
    """{name: (JITFunction, {head dim: [config kwargs + num_warps/num_stages]}, fixed constexprs,
    pointer types overriding POINTERS)} for every kernel the two backwards and the forward launch: the
    configs the autotuner tries at that head dim and TABLE's choices for it (`configs_at`)."""
    from model import attention_triton as at

    if at.INTERPRET:
        raise RuntimeError("TRITON_INTERPRET=1 is set: the kernels are interpreted and cannot be compiled")

    def per_head_dim(kernel):
        return {arch: {d: [_config_dict(c) for c in at.triton_configs(configs_at(kernel, d, arch), KERNELS[kernel][1])]
                       for d in HEAD_DIMS} for arch in ARCHS}

    preprocess = {arch: {d: [{"BLOCK_M": at.PREPROCESS_BLOCK, "num_warps": 4, "num_stages": 3}] for d in HEAD_DIMS}
                  for arch in ARCHS}
    return {"forward": (at._fwd_kernel.fn, per_head_dim("forward"), {}, {}),
            "backward": (at._bwd_kernel.fn, per_head_dim("backward"), {"ATOMIC_DQ": True}, {}),
            "preprocess": (at._bwd_preprocess, preprocess, {"ZERO_DQ": True}, {}),
            "det-backward-dkdv": (at._bwd_kv_kernel.fn, per_head_dim("backward_kv"), {"ATOMIC_DQ": False}, {}),
            "det-backward-dq": (at._bwd_dq_kernel.fn, per_head_dim("backward_dq"), {}, {"DQ": "in"}),
            "det-preprocess": (at._bwd_preprocess, preprocess, {"ZERO_DQ": False}, {"DQ": "in"})}


def configs_at(kernel: str, head_dim: int, arch: int) -> list[tuple]:
    """The entries compiled for a kernel of model/attention_configs.py (KERNELS' names) at one head dim: on
    TUNED_ARCH the autotuner's candidates and TABLE's choices for every T bucket, elsewhere TABLE's only."""
    tuned = candidates(KERNELS[kernel][0], head_dim) if arch == TUNED_ARCH else []
    return list(dict.fromkeys([*tuned, *table_entries(kernel, head_dim)]))


def _config_dict(config):
    return {**config.kwargs, "num_warps": config.num_warps, "num_stages": config.num_stages}


def compile_case(kernel_name: str, config: dict, head_dim: int, dtype: str, arch: int) -> dict:
    """Compile one kernel for sm_<arch>; return its config, registers, stack bytes, shared memory and
    counts of wgmma, atomic and bulk-tensor instructions."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn, _, fixed, pointer_types = kernels()[kernel_name]
    pointers = {**POINTERS, **pointer_types}
    meta = {k: v for k, v in config.items() if k not in ("num_warps", "num_stages")}
    params = {p.name for p in fn.params if p.is_constexpr}
    constexprs = {"HEAD_DIM": head_dim, "BLOCK_D": max(16, triton.next_power_of_2(head_dim)), **meta, **fixed}
    if "DOT_PRECISION" in params:
        constexprs["DOT_PRECISION"] = "tf32"  # what the kernels get for bf16/fp16 (ignored for them)
    if "HOPPER" in params:
        constexprs["HOPPER"] = arch >= 90  # the Hopper path on sm_90, pointer loads and dQ = dS K before it
    signature, attrs = {}, {}
    for index, param in enumerate(fn.params):
        name = param.name
        if param.is_constexpr:
            signature[name] = "constexpr"
            continue
        if name in pointers:
            signature[name] = "*" + (dtype if pointers[name] == "in" else pointers[name])
        elif name in FLOATS:
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
        if name in pointers or re.fullmatch(r"s[a-z]+", name):  # pointers and strides: multiples of 16
            attrs[(index,)] = [["tt.divisibility", 16]]
    missing = set(constexprs) - params
    unset = params - set(constexprs)
    if unset:
        raise ValueError(f"{kernel_name}: constexprs {sorted(unset)} of {fn.__name__} are given no value")
    if missing:
        raise ValueError(f"{kernel_name}: constexprs {sorted(missing)} are not parameters of {fn.__name__}")
    source = ASTSource(fn, signature, constexprs={(fn.arg_names.index(k),): v for k, v in constexprs.items()},
                       attrs=attrs)
    compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32),
                              options={"num_warps": config["num_warps"], "num_stages": config["num_stages"]})
    usage = _resource_usage(compiled.asm["cubin"])
    ptx = compiled.asm["ptx"]
    return {"kernel": kernel_name, "config": config, "head_dim": head_dim, "dtype": dtype, "arch": arch,
            "registers": usage["REG"], "stack": usage["STACK"], "local": usage["LOCAL"],
            "shared": compiled.metadata.shared, "wgmma": ptx.count("wgmma.mma_async"), "mma_sync": ptx.count("mma.sync"),
            "atomics": len(ATOMIC_RE.findall(ptx)), "bulk_tensor": ptx.count("cp.async.bulk.tensor")}


def _resource_usage(cubin: bytes) -> dict[str, int]:
    """REG, STACK, SHARED, LOCAL, ... of the one function in a cubin, from `cuobjdump --dump-resource-usage`."""
    from triton import knobs

    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([knobs.nvidia.cuobjdump.path, "--dump-resource-usage", f.name],
                             check=True, capture_output=True, text=True).stdout
    line = next(line for line in out.splitlines() if "REG:" in line)
    return {key: int(value) for key, value in re.findall(r"([A-Z]+(?:\[\d+\])?):(\d+)", line)}


# A config that does spill (192 B at head dim 128 on sm_90, triton 3.6 and 3.9): compiled with
# --control, so the test can show that the stack check sees spills at all.
SPILLING_CONTROL = ("forward", {"BLOCK_M": 128, "BLOCK_N": 64, "MASK_N": 32, "num_warps": 4, "num_stages": 3},
                    128, "bf16", 90)


def all_cases():
    """Every (kernel, config, head dim, dtype, arch) the test must compile."""
    return [(name, config, d, dtype, arch)
            for name, (_, configs, _, _) in kernels().items() for arch in ARCHS for d in HEAD_DIMS
            for config in configs[arch][d] for dtype in DTYPES]


def compile_all(workers: int | None = None, control: bool = False) -> list[dict]:
    cases = all_cases() + ([SPILLING_CONTROL] if control else [])
    workers = workers or min(os.cpu_count() or 1, len(cases))
    # fork: the workers inherit the imported kernels instead of importing torch and triton again
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
        return list(pool.map(compile_case, *zip(*cases)))


def print_table(records):
    print(f"{'kernel':<17} {'config (M, N, mask, warps, stages)':<36} {'arch':>5} {'dtype':>5} {'d':>4} "
          f"{'regs':>5} {'stack B':>7} {'smem KiB':>8} {'wgmma':>6} {'mma.sync':>8} {'TMA':>4} {'atomic':>6}")
    for r in records:
        c = r["config"]
        blocks = tuple(v for k, v in c.items() if k not in ("num_warps", "num_stages"))
        name = f"{blocks + (c['num_warps'], c['num_stages'])}"
        print(f"{r['kernel']:<17} {name:<36} {'sm_' + str(r['arch']):>5} {r['dtype']:>5} {r['head_dim']:>4} "
              f"{r['registers']:>5} {r['stack']:>7} {r['shared'] / 1024:>8.1f} {r['wgmma']:>6} {r['mma_sync']:>8} "
              f"{r['bulk_tensor']:>4} {r['atomics']:>6}")


# The prune (--prune): model/attention_configs.py's names → this file's kernels. The deterministic
# dK/dV pass is the atomic kernel without its dQ product and takes the atomic one's survivors.
PRUNED = {"forward": "forward", "backward": "backward", "backward_dq": "det-backward-dq"}
PRUNE_HEAD_DIMS = (64, 128)  # 80 and 96 pad to 128 columns (BLOCK_D): SWEEP gives them 128's survivors
SHARED_LIMIT_90 = 227 * 1024  # the largest dynamic shared memory one block may use on an H100


def passes_on_hopper(record: dict) -> bool:
    """An sm_90 compile the kernels may run: no spills, shared memory within the H100's limit, every
    product a wgmma (no mma.sync), the inner tiles read by TMA (cp.async.bulk.tensor)."""
    return (not record["stack"] and not record["local"] and record["shared"] <= SHARED_LIMIT_90
            and record["wgmma"] > 0 and not record["mma_sync"] and record["bulk_tensor"] > 0)


def prune(workers: int | None = None) -> list[dict]:
    """Every configuration of `space` compiled for sm_90 in bf16 at PRUNE_HEAD_DIMS; each record
    carries `passes` (`passes_on_hopper`)."""
    cases = [(PRUNED[kernel], dict(zip(("BLOCK_M", "BLOCK_N", KERNELS[kernel][1], "num_warps", "num_stages"), entry)),
              d, "bf16", 90) for kernel in PRUNED for d in PRUNE_HEAD_DIMS for entry in space(kernel)]
    workers = workers or min(os.cpu_count() or 1, len(cases))
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
        records = list(pool.map(compile_case, *zip(*cases)))
    return [{**r, "passes": passes_on_hopper(r)} for r in records]


def sweep_table(records) -> dict:
    """SWEEP (model/attention_configs.py) from `prune`'s records: {kernel: {head dim: [entries]}}."""
    names = {helper: kernel for kernel, helper in PRUNED.items()}
    sweep = {kernel: {d: [] for d in PRUNE_HEAD_DIMS} for kernel in PRUNED}
    for r in records:
        if r["passes"]:
            kernel = names[r["kernel"]]
            entry = tuple(r["config"][k] for k in ("BLOCK_M", "BLOCK_N", KERNELS[kernel][1], "num_warps", "num_stages"))
            sweep[kernel][r["head_dim"]].append(entry)
    return sweep


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="one JSON record per line instead of the table")
    parser.add_argument("--workers", type=int, help="parallel compiles (default: one per CPU)")
    parser.add_argument("--control", action="store_true", help="also compile SPILLING_CONTROL, last")
    parser.add_argument("--prune", action="store_true",
                        help="compile the configuration space for sm_90 and print SWEEP (model/attention_configs.py)")
    args = parser.parse_args()
    if args.prune:
        records = prune(args.workers)
        if args.json:
            for r in records:
                print(json.dumps(r))
        else:
            print_table(records)
            print("SWEEP =", repr(sweep_table(records)))
        return
    records = compile_all(args.workers, args.control)
    if args.json:
        for r in records:
            print(json.dumps(r))
    else:
        print_table(records)


if __name__ == "__main__":
    main()
