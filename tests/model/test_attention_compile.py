"""The attention kernels compiled ahead of time for sm_80 (A100) and sm_90 (H100), on the CPU:
every kernel of the forward and of both backwards (the default one with atomic dQ adds, the
deterministic one with its dK/dV pass and dQ pass), head dims 64/80/96/128, each with its TABLE
choices (model/attention_configs.py) and, for sm_90, every autotune config it tunes over, in bf16
(training's dtype; fp16's results are the interpreter tests'),
with no register spills, shared memory within the architecture's per-block limit, no atomic
instruction in the deterministic kernels, and on Hopper every product a `wgmma` (no Ampere
`mma.sync` left) and the inner loops' tiles read by TMA bulk tensor copies (`cp.async.bulk.tensor`:
the kernels' HOPPER path, which sm_90 compiles; sm_80 keeps pointer loads and dQ = dS K).
tests/helpers/attention_compile.py does the compiling, in a subprocess without TRITON_INTERPRET=1 (which
the interpreter tests set for this whole pytest process).

About 3 CPU-minutes when Triton's cache is cold (88 kernels), seconds when it is warm.
"""

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HELPERS = Path(__file__).resolve().parents[1] / "helpers"
HEAD_DIMS = (64, 80, 96, 128)
HALF_DTYPES = ("bf16",)
ARCHS = (80, 90)
# Largest dynamic shared memory one block may use: 163 KiB on A100 (sm_80), 227 KiB on H100 (sm_90).
SHARED_LIMIT = {80: 163 * 1024, 90: 227 * 1024}
# The deterministic backward's kernels; the default backward's "backward" adds dQ atomically.
DETERMINISTIC_KERNELS = ("det-preprocess", "det-backward-dkdv", "det-backward-dq")


@pytest.fixture(scope="module")
def compiled():
    """(records of every case, the record of the spilling control case)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(HELPERS / "attention_compile.py"), "--json", "--control"],
                          env=env, capture_output=True, text=True, timeout=3600)
    assert proc.returncode == 0, proc.stderr[-5000:]
    records = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return records[:-1], records[-1]


def _name(r):
    blocks = tuple(r["config"].values())
    return f"{r['kernel']} {blocks} sm_{r['arch']} {r['dtype']} d={r['head_dim']}"


def _expected_cases():
    """(kernel, config items, head dim, dtype, arch) for the configurations model/attention_configs.py
    declares: each head dim's TABLE choices, and on sm_90 its autotune candidates too."""
    from model import attention_configs as ac
    from model import attention_triton as at

    def items(entry, mask):
        return tuple(zip(("BLOCK_M", "BLOCK_N", mask, "num_warps", "num_stages"), entry))

    tuned = (("forward", "forward"), ("backward", "backward"), ("det-backward-dkdv", "backward_kv"),
             ("det-backward-dq", "backward_dq"))
    cases = set()
    for d, dtype, arch in itertools.product(HEAD_DIMS, HALF_DTYPES, ARCHS):
        for kernel, name in tuned:
            tuning, mask = ac.KERNELS[name]
            autotuned = ac.candidates(tuning, d) if arch == 90 else []  # sm_80: TABLE's choices only
            cases |= {(kernel, items(e, mask), d, dtype, arch) for e in [*autotuned, *ac.table_entries(name, d)]}
        preprocess = (("BLOCK_M", at.PREPROCESS_BLOCK), ("num_warps", 4), ("num_stages", 3))
        cases |= {(kernel, preprocess, d, dtype, arch) for kernel in ("preprocess", "det-preprocess")}
    return cases


def test_every_config_head_dim_dtype_and_arch_is_compiled(compiled):
    records, _ = compiled
    got = [(r["kernel"], tuple(r["config"].items()), r["head_dim"], r["dtype"], r["arch"]) for r in records]
    assert len(got) == len(set(got)) and set(got) == _expected_cases()


def test_no_register_spills(compiled):
    records, _ = compiled
    spilling = [f"{_name(r)}: {r['stack']} B stack, {r['local']} B local" for r in records if r["stack"] or r["local"]]
    assert not spilling, "configs that spill registers:\n" + "\n".join(spilling)


def test_the_spill_check_sees_spills(compiled):
    _, control = compiled
    assert control["stack"] > 0, f"{_name(control)} should spill at 4 warps; got {control}"


def test_shared_memory_fits_each_architecture(compiled):
    records, _ = compiled
    too_big = [f"{_name(r)}: {r['shared']} B" for r in records if r["shared"] > SHARED_LIMIT[r["arch"]]]
    assert not too_big, "configs over the shared-memory limit:\n" + "\n".join(too_big)


def test_every_hopper_product_is_a_wgmma_and_ampere_code_has_none(compiled):
    """On sm_90 each kernel's matmuls are wgmma instructions, none left as Ampere's mma.sync (which
    Triton falls back to for a product it cannot shape for a warpgroup, such as fewer than 64 rows)."""
    records, _ = compiled
    matmul_kernels = [r for r in records if not r["kernel"].endswith("preprocess")]
    assert matmul_kernels
    hopper = [r for r in matmul_kernels if r["arch"] == 90]
    assert not [_name(r) for r in hopper if not r["wgmma"] or r["mma_sync"]], \
        [f"{_name(r)}: {r['wgmma']} wgmma, {r['mma_sync']} mma.sync" for r in hopper if not r["wgmma"] or r["mma_sync"]]
    assert all(r["wgmma"] == 0 and r["mma_sync"] > 0 for r in matmul_kernels if r["arch"] == 80)


def test_deterministic_kernels_have_no_atomics(compiled):
    """The deterministic backward's PTX holds no atom./red. instruction: no sum depends on the order
    programs finish. The default backward's dQ adds are found, so the count can see atomics."""
    records, _ = compiled
    with_atomics = [f"{_name(r)}: {r['atomics']}" for r in records
                    if r["kernel"] in DETERMINISTIC_KERNELS and r["atomics"]]
    assert not with_atomics, "deterministic kernels with atomic instructions:\n" + "\n".join(with_atomics)
    assert {r["kernel"] for r in records} >= set(DETERMINISTIC_KERNELS)
    assert all(r["atomics"] > 0 for r in records if r["kernel"] == "backward")
    assert all(r["atomics"] == 0 for r in records if r["kernel"] == "forward")


def test_hopper_inner_tiles_are_tma_bulk_copies(compiled):
    """Every sm_90 matmul kernel reads tiles with TMA bulk tensor copies; sm_80 code and the
    preprocess kernels (one pointer load per tile) have none."""
    records, _ = compiled
    hopper = [r for r in records if r["arch"] == 90 and not r["kernel"].endswith("preprocess")]
    assert hopper and not [_name(r) for r in hopper if not r["bulk_tensor"]]
    assert not [_name(r) for r in records if r["bulk_tensor"] and (r["arch"] == 80 or r["kernel"].endswith("preprocess"))]
