"""Build a wheelhouse: every wheel gpt3d needs that a target machine lacks, for that machine's Python and
platform, so that `bash scripts/setup.sh --offline DIR` can install gpt3d there with no network.

Run through scripts/wheelhouse.sh, on a machine with the network (any OS pip runs on; Linux to build
the wheels that exist only as source). The steps:

1. What the target has (--have FILE, a requirements-style list; default scripts/gpu-node.txt). A line
   pinned to one version (`name==1.2.3`, as `pip freeze` writes) stands for itself: it becomes an empty
   placeholder wheel of that version, so nothing of it is fetched, not even to read its requirements.
   Any other line (`name`, `name>=1`) is resolved from the index, and its own requirements count as
   present too. torch, triton and the NVIDIA/CUDA wheels must be pinned: resolving them would fetch
   gigabytes.
2. pip resolves gpt3d with its gpu-suite extras and its build requirements for the target (--python,
   --platform: pip's cross-platform flags, binary wheels only) against those placeholders, as a dry
   run with a report. A package with no wheel on the index is built here from its source
   distribution (deepspeed with DS_BUILD_OPS=0: no op compiled ahead of time; future,
   antlr4-python3-runtime) and the resolution runs again; for another platform such a build must
   give a pure-Python wheel.
3. The wheelhouse gets every resolved wheel except what the target has (the pinned lines, and the
   unpinned ones with everything they require), plus the build requirements (pip's isolated build of
   gpt3d's editable install sees none of the target's packages). Wheels already in the folder are
   kept; wheels of earlier builds that are no longer needed are removed.
4. wheelhouse.json in the folder records the target, the packages (name, version, file, bytes,
   sha256, where it came from) and a digest of the inputs; a later run with the same inputs finds
   everything present and stops there (--refresh resolves again, for newer releases).

Exit codes: 0 done, 1 pip failed (its last lines are printed), 2 bad input (one line).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

try:
    from packaging.requirements import InvalidRequirement, Requirement
    from packaging.utils import canonicalize_name
except ImportError:  # pip always carries a copy
    from pip._vendor.packaging.requirements import InvalidRequirement, Requirement
    from pip._vendor.packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[1]
DEFAULT_HAVE = REPO / "scripts" / "gpu-node.txt"
DEFAULT_PYTHON = "3.12"
DEFAULT_PLATFORM = "manylinux_2_28_x86_64"
PROJECT = "gpt3d"
EXTRAS = "gpu-suite"  # what the GPU suite runs with (pyproject.toml): no lm-eval
BUILT_LIST = ".built-from-source"  # in the folder: the wheels built there, one file name a line
PLACEHOLDER_LABEL = "have"  # local version label of the placeholders: higher than the index's release
MAX_SOURCE_BUILDS = 10
HEAVY = re.compile(r"^(torch|triton|pytorch-triton|nvidia-.*|cuda-.*)$")
MISSING = re.compile(r"Could not find a version that satisfies the requirement (\S+)")
# pip's other way of saying it, inside a conflict: the names, then "depends on NAME<spec>" lines
UNAVAILABLE = re.compile(r"no matching distributions available for your environment:\n((?:[ \t]+\S+\n?)+)")
# older pip (23.x) names only the conflict: every candidate "depends on" the same wheel-less requirement
CONFLICT = re.compile(r"The conflict is caused by:\n((?:[ \t]+.+ depends on \S+\n?)+)")
MIB = 2**20


class BadInput(Exception):
    """Input the user must fix: printed as one line, exit code 2."""


class PipFailed(Exception):
    """pip failed: the message and pip's last lines are printed, exit code 1."""


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return build(args)
    except BadInput as err:
        print(f"wheelhouse: {err}", file=sys.stderr)
        return 2
    except PipFailed as err:
        print(f"wheelhouse: {err}", file=sys.stderr)
        return 1


class OneLineParser(argparse.ArgumentParser):
    """argparse, with a usage error as one line naming the valid options, exit code 2."""

    def error(self, message):
        options = ", ".join(a.option_strings[-1] for a in self._actions if a.option_strings)
        self.exit(2, f"wheelhouse: {message}; valid: {options}\n")


def parse_args(argv):
    parser = OneLineParser(prog="scripts/wheelhouse.sh", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--python", default=DEFAULT_PYTHON, metavar="X.Y",
                        help=f"the target's CPython version (default {DEFAULT_PYTHON})")
    parser.add_argument("--platform", default=DEFAULT_PLATFORM, metavar="TAG",
                        help=f"the target's platform tag; manylinux_2_N_ARCH takes every older manylinux too "
                             f"(default {DEFAULT_PLATFORM}: glibc 2.28, as CUDA builds of torch need)")
    parser.add_argument("--native", action="store_true",
                        help="target this machine: the Python running this script and its platform "
                             "(--python and --platform do not apply)")
    parser.add_argument("--have", type=Path, default=DEFAULT_HAVE, metavar="FILE",
                        help="what the target already has: a pip freeze of it, or a shorter list "
                             f"(default {DEFAULT_HAVE.relative_to(REPO)})")
    parser.add_argument("--interpreter", metavar="PATH",
                        help="a Python of the target's version on this machine, for pip to evaluate "
                             "environment markers as the target will (default: pythonX.Y on PATH, if any)")
    parser.add_argument("--out", type=Path, metavar="DIR",
                        help="the wheelhouse folder (default wheelhouse/<cpXY>-<platform>, or "
                             "wheelhouse/native-<cpXY> with --native)")
    parser.add_argument("--refresh", action="store_true",
                        help="resolve again even when the folder matches its inputs (picks up new releases)")
    args = parser.parse_args(argv)
    if args.native:
        args.python = f"{sys.version_info.major}.{sys.version_info.minor}"
        args.platform = None
    elif not re.fullmatch(r"3\.\d+", args.python):
        parser.exit(2, f"wheelhouse: --python {args.python}: expected a CPython version such as 3.12\n")
    tag = "cp" + args.python.replace(".", "")
    args.out = args.out or REPO / "wheelhouse" / (f"native-{tag}" if args.native else f"{tag}-{args.platform}")
    return args


# --- what the target has ---------------------------------------------------------------------------

class Have:
    """One line of the have-file: a name, and its version when the line pins exactly one."""

    def __init__(self, name: str, requirement: str, version: str | None):
        self.name, self.requirement, self.version = name, requirement, version

    @property
    def placeholder_version(self) -> str:
        """The placeholder's version: the pinned one, with a local label when it has none, so that it
        sorts above the index's release of the same version and pip never takes that instead."""
        return self.version if "+" in self.version else f"{self.version}+{PLACEHOLDER_LABEL}"


def read_have(path: Path) -> list[Have]:
    """The have-file's packages. Comments, blank lines and pip options (-e, --index-url) are skipped;
    `name @ url` and editable lines count by name only, unpinned."""
    if not path.is_file():
        raise BadInput(f"--have {path}: no such file (a pip freeze of the target, or a list of names)")
    found: dict[str, Have] = {}
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.split(" #")[0].strip()
        if not line or line.startswith(("#", "-")):
            continue
        try:
            req = Requirement(line)
        except InvalidRequirement as err:
            raise BadInput(f"--have {path}, line {number}: {line!r} is not a requirement ({err})") from None
        name = canonicalize_name(req.name)
        if name == PROJECT:
            continue  # an earlier install of gpt3d itself
        pins = [s.version for s in req.specifier if s.operator in ("==", "===") and "*" not in s.version]
        version = pins[0] if len(pins) == 1 and len(req.specifier) == 1 and not req.url else None
        if version is None and HEAVY.match(name):
            raise BadInput(f"--have {path}, line {number}: {line!r}: pin {name} to the target's version "
                           f"({name}==X.Y.Z, as pip freeze prints it): resolving it would fetch gigabytes")
        found[name] = Have(name, str(Requirement(req.name + str(req.specifier))) if not req.url else req.name,
                           version)
    return list(found.values())


def placeholder_wheel(folder: Path, have: Have) -> Path:
    """An empty wheel named and versioned as the target's package, with no requirements."""
    version = have.placeholder_version
    dist = f"{have.name.replace('-', '_')}-{version}"
    path = folder / f"{dist}-py3-none-any.whl"
    files = {f"{dist}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {have.name}\nVersion: {version}\n",
             f"{dist}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: gpt3d-wheelhouse\nRoot-Is-Purelib: true\n"
                                        "Tag: py3-none-any\n"}
    with zipfile.ZipFile(path, "w") as wheel:
        for name, text in files.items():
            wheel.writestr(name, text)
        record = f"{dist}.dist-info/RECORD"
        wheel.writestr(record, "".join(f"{name},,\n" for name in [*files, record]))
    return path


# --- the target's tags -------------------------------------------------------------------------------

def platform_tags(platform: str) -> list[str]:
    """pip takes a --platform literally, except the legacy manylinux2014/2010 names; a glibc floor such as
    manylinux_2_28_x86_64 also accepts every wheel built for an older glibc, so list them all."""
    match = re.fullmatch(r"manylinux_2_(\d+)_(\w+)", platform)
    if not match:
        return [platform]
    glibc, arch = int(match.group(1)), match.group(2)
    tags = [f"manylinux_2_{minor}_{arch}" for minor in range(glibc, 4, -1)]
    legacy = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}
    tags += [f"{name}_{arch}" for minor, name in legacy.items() if minor <= glibc]
    return tags


def target_flags(args) -> list[str]:
    """pip's flags for the target's wheels (none for this machine: pip's own tags then)."""
    if args.native:
        return []
    flags = ["--python-version", args.python, "--implementation", "cp", "--abi", "cp" + args.python.replace(".", "")]
    for tag in platform_tags(args.platform):
        flags += ["--platform", tag]
    return flags


def marker_interpreter(args) -> str | None:
    """A Python of the target's version, for `pip --python` (pip evaluates environment markers such as
    python_version with the interpreter it runs in); None when this one already is, or none is found."""
    if args.native or args.python == f"{sys.version_info.major}.{sys.version_info.minor}":
        return None
    candidates = [args.interpreter] if args.interpreter else [shutil.which(f"python{args.python}")]
    for candidate in filter(None, candidates):
        try:
            out = subprocess.run([candidate, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                                 capture_output=True, text=True, timeout=60)
        except OSError:
            out = None
        if out is not None and out.returncode == 0 and out.stdout.strip() == args.python:
            return candidate
        if args.interpreter:
            raise BadInput(f"--interpreter {args.interpreter}: not a working Python {args.python}")
    print(f"wheelhouse: note: no python{args.python} here; environment markers are evaluated for "
          f"{sys.version_info.major}.{sys.version_info.minor} (pass --interpreter PATH to match the target)")
    return None


# --- pip ---------------------------------------------------------------------------------------------

def pip(args_: list[str], interpreter: str | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "pip", *(["--python", interpreter] if interpreter else []), *args_]
    return subprocess.run(command, capture_output=True, text=True, env={**os.environ, **(env or {})})


def tail(proc: subprocess.CompletedProcess, lines: int = 25) -> str:
    useful = [line for line in (proc.stdout + proc.stderr).splitlines() if "is ignored: it is neither" not in line]
    return "\n".join(useful[-lines:])


def resolve(args, requirements, constraints: Path, find_links: list[Path], interpreter, scratch: Path) -> dict:
    """pip's dry-run resolution for the target, building from source whatever has no wheel; the report."""
    built: set[str] = set()
    for _ in range(MAX_SOURCE_BUILDS):
        report = scratch / "report.json"
        links = [f for folder in find_links for f in ("--find-links", str(folder))]
        proc = pip(["install", "--dry-run", "--ignore-installed", "--report", str(report),
                    "--only-binary=:all:", *target_flags(args), "--target", str(scratch / "target"), *links,
                    "--constraint", str(constraints), *requirements], interpreter)
        if proc.returncode == 0:
            return json.loads(report.read_text())
        requirement = missing_wheel(proc.stdout + proc.stderr)
        name = canonicalize_name(Requirement(requirement).name) if requirement else None
        if name is None or name in built:
            raise PipFailed(f"pip could not resolve {PROJECT} for the target:\n{tail(proc)}")
        wheel = build_from_source(args, requirement, args.out, interpreter)
        with open(args.out / BUILT_LIST, "a") as listed:
            listed.write(wheel.name + "\n")
        built.add(name)
    raise PipFailed(f"more than {MAX_SOURCE_BUILDS} packages without wheels; stopped")


def missing_wheel(output: str) -> str | None:
    """The requirement pip found no wheel for, from its error output (None when the failure is another)."""
    missing = MISSING.search(output)
    if missing:
        return missing.group(1)
    unavailable = UNAVAILABLE.search(output)
    if not unavailable:
        conflict = CONFLICT.search(output)
        wanted = {line.rsplit(" depends on ", 1)[1].strip() for line in conflict.group(1).splitlines()} if conflict else set()
        return wanted.pop() if len(wanted) == 1 else None
    name = unavailable.group(1).split()[0]
    wanted = re.search(rf"depends on ({re.escape(name)}\S*)", output, re.IGNORECASE)
    return wanted.group(1) if wanted else name


def build_from_source(args, requirement: str, out: Path, interpreter) -> Path:
    """A wheel of `requirement` built here from its source distribution (DeepSpeed with no op compiled
    ahead of time), into `out`; for another platform it must be pure Python."""
    name = canonicalize_name(Requirement(requirement).name)
    print(f"wheelhouse: {requirement} has no wheel on the index: building it from source")
    with tempfile.TemporaryDirectory(prefix="wheelhouse-build-") as folder:
        proc = pip(["wheel", "--no-deps", "--no-binary", name, "--wheel-dir", folder, requirement], interpreter,
                   env={"DS_BUILD_OPS": "0"})
        wheels = list(Path(folder).glob("*.whl"))
        if proc.returncode != 0 or len(wheels) != 1:
            raise PipFailed(f"building {requirement} from source failed:\n{tail(proc)}")
        wheel = wheels[0]
        if not args.native and not wheel.name.endswith("-none-any.whl"):
            raise PipFailed(f"{requirement} has no wheel for the target and its source builds a wheel for this "
                            f"machine only ({wheel.name}); build it on a machine like the target")
        out.mkdir(parents=True, exist_ok=True)
        return Path(shutil.copy2(wheel, out / wheel.name))


# --- what to keep ------------------------------------------------------------------------------------

def requirement_graph(report: dict) -> dict[str, list[Requirement]]:
    """name → its requirements, for every package pip resolved."""
    return {canonicalize_name(item["metadata"]["name"]): [Requirement(text) for text in
                                                            item["metadata"].get("requires_dist") or []]
            for item in report["install"]}


def closure(graph: dict, roots: set[str], environment: dict) -> set[str]:
    """Every resolved package reachable from `roots` (taken without extras) through requirements whose
    markers hold in `environment` (the one pip resolved for: its report says which), the roots included."""
    seen: set[tuple[str, frozenset]] = set()
    todo = [(name, frozenset()) for name in roots if name in graph]
    while todo:
        name, extras = todo.pop()
        if (name, extras) in seen:
            continue
        seen.add((name, extras))
        for req in graph[name]:
            dep = canonicalize_name(req.name)
            active = req.marker is None or any(req.marker.evaluate({**environment, "extra": extra})
                                               for extra in ["", *extras])
            if active and dep in graph:
                todo.append((dep, frozenset(req.extras)))
    return {name for name, _ in seen}


def build_requirements() -> list[str]:
    """gpt3d's [build-system] requires from pyproject.toml."""
    text = (REPO / "pyproject.toml").read_text()
    try:
        import tomllib
    except ImportError:  # Python 3.10
        from pip._vendor import tomli as tomllib
    return list(tomllib.loads(text)["build-system"]["requires"])


# --- the folder --------------------------------------------------------------------------------------

def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def inputs_digest(args, have_path: Path) -> str:
    """What the wheelhouse is a function of: the target, the have-file, gpt3d's requirements, this script."""
    digest = hashlib.sha256()
    target = f"native {sys.version} {sys.platform}" if args.native else f"{args.python} {args.platform}"
    for part in (target.encode(), have_path.read_bytes(), (REPO / "pyproject.toml").read_bytes(),
                 Path(__file__).read_bytes()):
        digest.update(hashlib.sha256(part).digest())
    return digest.hexdigest()


def up_to_date(manifest_path: Path, digest: str) -> dict | None:
    """The manifest when it matches the inputs and every wheel it lists is present at its size."""
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, ValueError):
        return None
    folder = manifest_path.parent
    if manifest.get("inputs_sha256") != digest:
        return None
    for package in manifest["packages"]:
        path = folder / package["file"]
        if not path.is_file() or path.stat().st_size != package["bytes"]:
            return None
    return manifest


def built_here(folder: Path) -> set[str]:
    """The wheels built from source into `folder`, by this run or an earlier one (none are on the index)."""
    try:
        return set((folder / BUILT_LIST).read_text().split())
    except OSError:
        return set()


def owned_by_earlier_runs(folder: Path) -> set[str]:
    """The wheel files an earlier run put in `folder`: the ones its manifest lists and the ones built there."""
    try:
        listed = {p["file"] for p in json.loads((folder / "wheelhouse.json").read_text())["packages"]}
    except (OSError, ValueError, KeyError):
        listed = set()
    return listed | built_here(folder)


def fetch(args, items: list[dict], out: Path, interpreter) -> None:
    """Each resolved wheel not yet in `out`, from the address pip resolved, checked against its sha256."""
    todo = []
    for item in items:
        info = item["download_info"]
        file = out / info["url"].rsplit("/", 1)[-1]
        expected = (info.get("archive_info") or {}).get("hashes", {}).get("sha256")
        if file.is_file() and (expected is None or sha256(file) == expected):
            continue
        todo.append(item)
    if todo:
        print(f"wheelhouse: downloading {len(todo)} wheels")
        proc = pip(["download", "--no-deps", "--quiet", "--dest", str(out), *target_flags(args),
                    *[item["download_info"]["url"] for item in todo]], interpreter)
        if proc.returncode != 0:
            raise PipFailed(f"pip download failed:\n{tail(proc)}")
    for item in items:
        info = item["download_info"]
        file = out / info["url"].rsplit("/", 1)[-1]
        expected = (info.get("archive_info") or {}).get("hashes", {}).get("sha256")
        if expected is not None and sha256(file) != expected:
            raise PipFailed(f"{file.name}: sha256 differs from the index's")


def build(args) -> int:
    have = read_have(args.have)
    digest = inputs_digest(args, args.have)
    manifest_path = args.out / "wheelhouse.json"
    manifest = None if args.refresh else up_to_date(manifest_path, digest)
    if manifest is not None:
        print(f"wheelhouse: {shown(args.out)} is up to date with its inputs (--refresh resolves again)")
        print_summary(manifest, args.out)
        return 0
    interpreter = marker_interpreter(args)
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    target = f"this machine (Python {args.python})" if args.native else f"CPython {args.python}, {args.platform}"
    print(f"wheelhouse: resolving {PROJECT}[{EXTRAS}] for {target}; the target has {len(have)} listed packages "
          f"({args.have})")
    with tempfile.TemporaryDirectory(prefix="wheelhouse-") as scratch_name:
        scratch = Path(scratch_name)
        placeholders = scratch / "placeholders"
        placeholders.mkdir()
        builds = build_requirements()
        build_names = {canonicalize_name(Requirement(r).name) for r in builds}
        # pip's isolated build of gpt3d sees none of the target's packages: its build requirements are
        # never placeholders, and always go into the wheelhouse
        pinned = [h for h in have if h.version is not None and h.name not in build_names]
        for h in pinned:
            placeholder_wheel(placeholders, h)
        constraints = scratch / "constraints.txt"
        constraints.write_text("".join(f"{h.name}=={h.placeholder_version}\n" for h in pinned))
        unpinned = [h.requirement for h in have if h.version is None and h.name not in build_names]
        requirements = [f"{REPO}[{EXTRAS}]", *builds, *unpinned]
        owned = owned_by_earlier_runs(args.out)
        report = resolve(args, requirements, constraints, [placeholders, args.out], interpreter, scratch)

        graph = requirement_graph(report)
        environment = report["environment"]
        present = closure(graph, {h.name for h in have}, environment)
        needed_for_build = closure(graph, build_names, environment)
        keep = [item for item in report["install"]
                if (name := canonicalize_name(item["metadata"]["name"])) != PROJECT
                and (name not in present or name in needed_for_build)]
        fetch(args, keep, args.out, interpreter)

    packages = []
    for item in sorted(keep, key=lambda i: canonicalize_name(i["metadata"]["name"])):
        name = canonicalize_name(item["metadata"]["name"])
        url = item["download_info"]["url"]
        file = args.out / url.rsplit("/", 1)[-1]
        source = "built here from source" if file.name in built_here(args.out) else url
        packages.append({"name": name, "version": item["metadata"]["version"],
                         "file": file.name, "bytes": file.stat().st_size, "sha256": sha256(file), "source": source})
    wanted = {p["file"] for p in packages}
    owned |= built_here(args.out)
    stale = sorted(f for f in args.out.glob("*.whl") if f.name not in wanted and f.name in owned)
    for f in stale:
        f.unlink()
    if stale:
        print(f"wheelhouse: removed {len(stale)} wheels of an earlier build: {', '.join(f.name for f in stale)}")
    (args.out / BUILT_LIST).write_text("".join(f"{name}\n" for name in sorted(built_here(args.out) & wanted)))
    foreign = sorted(f.name for f in args.out.glob("*.whl") if f.name not in wanted)
    if foreign:
        print(f"wheelhouse: note: {len(foreign)} other wheels in {shown(args.out)}, not put there by this script, "
              f"were left; pip on the target will see them too: {', '.join(foreign)}")
    # what the wheelhouse takes the target to have, at the versions the resolution saw (a placeholder's
    # version for the pinned lines)
    skipped = sorted(({"name": canonicalize_name(i["metadata"]["name"]), "version": i["metadata"]["version"]}
                      for i in report["install"]
                      if canonicalize_name(i["metadata"]["name"]) in present - needed_for_build),
                     key=lambda p: p["name"])
    manifest = {"target": {"python": args.python, "platform": args.platform or "native", "native": args.native},
                "have": str(args.have), "skipped": skipped, "packages": packages,
                "total_bytes": sum(p["bytes"] for p in packages), "inputs_sha256": digest,
                "created": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                "pip": report.get("pip_version"), "resolved_for": report["environment"].get("python_full_version")}
    tmp = manifest_path.with_name(manifest_path.name + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1) + "\n")
    tmp.replace(manifest_path)
    print_summary(manifest, args.out)
    print(f"wheelhouse: done in {time.monotonic() - started:.0f} s")
    return 0


def shown(path: Path) -> str:
    """`path` relative to the current folder when it lies inside it (as the user would type it)."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def print_summary(manifest: dict, out: Path) -> None:
    packages = manifest["packages"]
    width = max(len(p["name"]) for p in packages)
    lines = io.StringIO()
    for p in packages:
        note = "  (built here from source)" if p["source"] == "built here from source" else ""
        lines.write(f"  {p['name']:<{width}}  {p['version']:<14} {p['bytes'] / MIB:7.2f} MiB{note}\n")
    print(lines.getvalue(), end="")
    skipped = ", ".join(p["name"] for p in manifest["skipped"]) or "nothing"
    print(f"wheelhouse: skipped, the target has them: {skipped}")
    print(f"wheelhouse: {len(packages)} wheels, {manifest['total_bytes'] / MIB:.1f} MiB in {shown(out)}")


if __name__ == "__main__":
    sys.exit(main())
