"""Compile gpt3d's Triton kernels other than the attention's ahead of time for a GPU, on the CPU: the fused loss's
two row kernels (model/loss_rows_triton.py) in bf16 for sm_80 and sm_90, and the float8 cast
(model/float8_cast_triton.py) from bf16 to both float8 formats and the float8 scales (model/float8_scale_triton.py)
for sm_90 (float8 runs on Hopper). Prints one JSON line per kernel: its name, arch, registers, stack bytes, the
float8 conversions and the divisions its PTX uses.

  python tests/helpers/kernels_compile.py      # TRITON_INTERPRET must be unset: interpreted kernels do not compile

What tests/model/test_kernels_compile.py checks; attention_compile.py does the same for the attention kernels.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parent)]

BLOCK_V, CAST_BLOCK = 2048, 64  # what the kernels launch with on a GPU


def _compile(fn, types: dict, constexprs: dict, arch: int):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {p.name: "constexpr" if p.is_constexpr else types.get(p.name, "i32") for p in fn.params}
    source = ASTSource(fn, signature, constexprs={(fn.arg_names.index(k),): v for k, v in constexprs.items()})
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options={"num_warps": 4})


def cases() -> list[dict]:
    import torch

    from attention_compile import _resource_usage
    from model import float8_cast_triton as cast
    from model import float8_scale_triton as scales
    from model import loss_rows_triton as loss

    if loss.INTERPRET or cast.INTERPRET or scales.INTERPRET:
        raise RuntimeError("TRITON_INTERPRET=1 is set: the kernels are interpreted and cannot be compiled")
    rows = {"Z": "*bf16", "TARGETS": "*i64", "OWNED": "*i1", "M": "*fp32", "S": "*fp32", "T": "*fp32", "SCALE": "*fp32"}
    jobs = [(f"loss {name}", fn, rows, {"BLOCK": BLOCK_V}, arch)
            for name, fn in (("row stats", loss._row_stats_kernel), ("row grad", loss._row_grad_kernel)) for arch in (80, 90)]
    for dtype, triton_type in ((torch.float8_e4m3fn, "fp8e4nv"), (torch.float8_e5m2, "fp8e5")):
        f_max, mantissa, min_exponent = cast._FORMATS[dtype]
        jobs.append((f"float8 cast to {triton_type}", cast._cast_kernel, {"A": "*bf16", "S": "*fp32", "OUT": "*" + triton_type},
                     {"F_MAX": f_max, "MANTISSA": mantissa, "MIN_EXPONENT": min_exponent, "BLOCK_M": CAST_BLOCK,
                      "BLOCK_N": CAST_BLOCK}, 90))
    jobs.append(("float8 scales", scales._scales_kernel, {"AMAX": "*fp32", "SCALE": "*fp32", "INVERSE": "*fp32"},
                 {"F_MAX": 448.0, "BLOCK": 2}, 90))
    records = []
    for name, fn, types, constexprs, arch in jobs:
        compiled = _compile(fn, types, constexprs, arch)
        usage = _resource_usage(compiled.asm["cubin"])
        records.append({"kernel": name, "arch": arch, "registers": usage["REG"], "stack": usage["STACK"],
                        "local": usage["LOCAL"], "float8_conversions": sorted(set(
                            re.findall(r"cvt\.rn\.satfinite\.e\dm\dx2\.f32", compiled.asm["ptx"]))),
                        "divisions": sorted(set(re.findall(r"\bdiv(?:\.\w+)+", compiled.asm["ptx"])))})
    return records


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("kernels_compile.py: unset TRITON_INTERPRET to compile the kernels")
    for record in cases():
        print(json.dumps(record))
