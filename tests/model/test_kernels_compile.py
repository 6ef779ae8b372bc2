"""The fused loss's row kernels and the float8 cast compiled ahead of time for the GPUs they run on, on the CPU
(tests/helpers/kernels_compile.py, in a subprocess without TRITON_INTERPRET=1, which the interpreter tests set for
this pytest process): each compiles (a kernel that only the interpreter accepts fails here: a module global it
reads must be a tl.constexpr object), spills no register (no stack, no local memory), and the cast converts with
the hardware's rounding, saturating float8 instructions (cvt.rn.satfinite) to the format asked for; the float8
scales divide with IEEE rounding in float64 and float32 (div.rn: what torch's ops give), never an approximate
division."""

import json
import os
import subprocess
import sys
from pathlib import Path

HELPERS = Path(__file__).resolve().parents[1] / "helpers"


def test_the_kernels_compile_for_their_gpus_without_spills():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(HELPERS / "kernels_compile.py")], env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-5000:]
    records = {(r["kernel"], r["arch"]): r for r in map(json.loads, proc.stdout.splitlines())}
    assert set(records) == {("loss row stats", 80), ("loss row stats", 90), ("loss row grad", 80),
                            ("loss row grad", 90), ("float8 cast to fp8e4nv", 90), ("float8 cast to fp8e5", 90),
                            ("float8 scales", 90)}
    for key, record in records.items():
        assert record["stack"] == 0 and record["local"] == 0, (key, record)
    assert records["float8 cast to fp8e4nv", 90]["float8_conversions"] == ["cvt.rn.satfinite.e4m3x2.f32"]
    assert records["float8 cast to fp8e5", 90]["float8_conversions"] == ["cvt.rn.satfinite.e5m2x2.f32"]
    assert records["float8 scales", 90]["divisions"] == ["div.rn.f32", "div.rn.f64"]
