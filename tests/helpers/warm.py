"""A warm interpreter for the tests: torch, DeepSpeed, Hydra and gpt3d's run imported once, each command a fork.

Every `python -m train` a test starts would otherwise import torch, DeepSpeed, Hydra and gpt3d again (about
3 s of CPU a process here, half of a tiny run). The warm interpreter is one process per pytest worker that
imports them once, then forks for each command: the child takes the command's environment, working folder
and arguments, sends its output to two files and runs the module as `python -m` does (runpy, as
`__main__`); so the code under test is the same, only its imports were paid before (and, on a CPU build of
torch, two values a process computes once and keeps: DeepSpeed's op probe and the GPT-2 BPE; see
PRELOAD_IF_PRESENT). It also forks the ranks of a launch (the launcher's environment, as torchrun gives each
rank: RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), and the gloo ranks of
`distributed.run_distributed`.

What is read from the environment when a library is imported (TRITON_INTERPRET and GPT3D_TRITON_AUTOTUNE in
model/attention_triton.py, DeepSpeed's accelerator, torch's threads) is fixed when the interpreter imports
it: there is one interpreter per such environment (`SENSITIVE`), and it never imports what reads the
Hugging Face or W&B settings at import (datasets, huggingface_hub, transformers, wandb): those stay the
child's to import, so a test may set them per command.

    with_warm = Warm.shared()                     # this pytest worker's interpreters
    child = with_warm.start(["train", "train.max_steps=2"], env, cwd, out, err)
    codes = with_warm.wait(child, timeout=600)    # [exit code] (one per rank)

The protocol is one JSON object a line: requests on the interpreter's stdin, and on a pipe of its own the
pids of each started request and each child's exit status.
"""

from __future__ import annotations

import atexit
import io
import json
import os
import select
import signal
import subprocess
import sys
import threading
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HELPERS = Path(__file__).resolve().parent
# What the interpreter imports before it forks: the libraries and gpt3d's modules every run imports
# (not the commands themselves: each is run as __main__, as python -m runs it). torch._dynamo: torch imports
# it at a run's first random init on the meta device (1.4 s of CPU a process, the most of any import left).
PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "deepspeed", "hydra", "omegaconf", "numpy", "tiktoken",
           "train.run.loop", "train.run.spec", "train.run.build", "train.checkpoint.model_part", "train.evaluation")
# More of what the runs would do first, on a CPU build of torch (CI), where nothing of it can reach a GPU before
# the fork; each only where this DeepSpeed and checkout have it (otherwise the runs do it themselves, as before):
# - DeepSpeed's engine checks its optimizer against ZeRO's (deepspeed/runtime/zero/utils.py), which imports its
#   Muon optimizer, whose torch.compile at import pulls in torch._inductor: 1.1-1.6 s of CPU in every rank that
#   builds an engine (every launched layout; more than a tiny run's steps);
# - the checkpoint writer's imports (0.3 s);
# - deepspeed.ops.__compatible_ops__, which DeepSpeed computes on first use (parallel/topology.py reads it) by
#   probing every op, compiling a C program for one: 0.3 s a process, distutils' import included;
# - the GPT-2 BPE, built once per process (train/data/tokenizer.py): 0.45 s in every process that reads text.
PRELOAD_IF_PRESENT = ("deepspeed.runtime.zero.muon.muon_optimizer", "train.checkpoint.tensors")
# Never imported by the interpreter: they read settings from the environment when imported
NOT_PRELOADED = ("datasets", "huggingface_hub", "transformers", "wandb", "lm_eval")
# Environment read when the interpreter starts (PYTHON*, the test hooks' GPT3D_TEST_* read by a sitecustomize)
# or imports the preloaded modules: commands that differ here get another interpreter
SENSITIVE = ("TRITON_", "GPT3D_TRITON_", "GPT3D_TEST_", "DS_", "OMP_", "MKL_", "PYTORCH_", "TORCH_", "TORCHDYNAMO_",
             "TORCHINDUCTOR_", "CUDA_", "PYTHON")
MAX_SERVERS = 3  # interpreters kept at once, each about 500 MB (400 before its warm-up)
LAUNCHER = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK",
            "ROLE_RANK", "ROLE_WORLD_SIZE")


def sensitive(env: dict) -> tuple:
    """The part of `env` the interpreter's imports read, as a key."""
    return tuple(sorted((k, v) for k, v in env.items() if k.startswith(SENSITIVE)))


class Warm:
    """This process's warm interpreters, one per sensitive environment, started when first asked for."""

    _shared: Warm | None = None

    def __init__(self):
        self._servers: dict[tuple, _Server] = {}
        atexit.register(self.close)

    @classmethod
    def shared(cls) -> Warm:
        if cls._shared is None:
            cls._shared = cls()
        return cls._shared

    def start(self, command: list[str], env: dict, cwd: Path, out: Path, err: Path, ranks: int = 0,
              port: int | None = None) -> _Child:
        """`python -m <command[0]> <command[1:]>` forked with `env` in `cwd`, its output to `out` and `err`;
        with `ranks`, that many ranks of a launch on `port`, all writing to the same two files."""
        request = {"op": "run", "argv": command, "env": env, "cwd": str(cwd), "out": str(out), "err": str(err),
                   "ranks": ranks, "port": port}
        return self._server(env).request(request)

    def call(self, module_file: str, module_name: str, qualname: str, args_file: Path, world: int, port: int,
             result_dir: Path, threads: int, timeout: float, env: dict, err: str) -> _Child:
        """`qualname` of the module at `module_file` called on `world` gloo ranks (distributed.run_distributed);
        each rank's stderr to `err` with {rank} filled in."""
        request = {"op": "call", "file": module_file, "module": module_name, "qualname": qualname,
                   "args": str(args_file), "world": world, "port": port, "results": str(result_dir),
                   "threads": threads, "timeout": timeout, "env": env, "err": err}
        return self._server(env).request(request)

    def wait(self, child: _Child, timeout: float) -> list[int] | None:
        """Each forked process's exit code, or None (and every one killed) when they outlast `timeout`."""
        return child.server.wait(child, timeout)

    def exit_codes(self, child: _Child) -> list[int | None]:
        """Each forked process's exit code so far (None: still running), without waiting."""
        return child.server.exit_codes(child)

    def close(self) -> None:
        for server in self._servers.values():
            server.close()
        self._servers.clear()

    def _server(self, env: dict) -> _Server:
        """The interpreter for `env`'s sensitive part (the last MAX_SERVERS used are kept)."""
        key = sensitive(env)
        server = self._servers.pop(key, None)
        if server is None or not server.alive():
            while len(self._servers) >= MAX_SERVERS:
                self._servers.pop(next(iter(self._servers))).close()
            server = _Server({k: v for k, v in env.items() if k not in LAUNCHER})
        self._servers[key] = server  # the most recently used last
        return server


class _Child:
    def __init__(self, server: _Server, request_id: int):
        self.server, self.id, self.pids = server, request_id, []


class _Server:
    """One warm interpreter and the thread that reads what it reports."""

    def __init__(self, env: dict):
        reports_read, reports_write = os.pipe()
        code = (f"import sys; sys.path[:0] = [{str(REPO)!r}, {str(HELPERS)!r}]; "
                f"import warm; warm.serve({reports_write})")
        self.proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=env, stdin=subprocess.PIPE,
                                     pass_fds=(reports_write,), text=True)
        os.close(reports_write)
        self.reports = os.fdopen(reports_read, "r")
        self.lock, self.done = threading.Condition(), {}
        self.pids: dict[int, list[int]] = {}  # request id → its children's pids
        self.status: dict[int, int] = {}  # pid → exit code
        self.next_id = 0
        self.ended = False  # its report pipe closed: it has ended
        threading.Thread(target=self._read, daemon=True).start()

    def alive(self) -> bool:
        return not self.ended and self.proc.poll() is None

    def request(self, request: dict) -> _Child:
        with self.lock:
            self.next_id += 1
            child = _Child(self, self.next_id)
        self.proc.stdin.write(json.dumps({**request, "id": child.id}) + "\n")
        self.proc.stdin.flush()
        with self.lock:
            if not self.lock.wait_for(lambda: child.id in self.pids or not self.alive(), timeout=300):
                raise RuntimeError("the warm interpreter did not start the command within 300 s")
            if child.id not in self.pids:
                raise RuntimeError("the warm interpreter ended")
            child.pids = self.pids[child.id]
        return child

    def wait(self, child: _Child, timeout: float) -> list[int] | None:
        with self.lock:
            finished = self.lock.wait_for(lambda: all(p in self.status for p in child.pids), timeout=timeout)
            if finished:
                return [self.status.pop(p) for p in child.pids]
        for pid in child.pids:  # its own session: the process and whatever it started
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        with self.lock:
            self.lock.wait_for(lambda: all(p in self.status for p in child.pids), timeout=30)
            for pid in child.pids:
                self.status.pop(pid, None)
        return None

    def exit_codes(self, child: _Child) -> list[int | None]:
        with self.lock:
            return [self.status.get(p) for p in child.pids]

    def close(self) -> None:
        if self.alive():
            try:
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()

    def _read(self) -> None:
        for line in self.reports:
            report = json.loads(line)
            with self.lock:
                if "pids" in report:
                    self.pids[report["id"]] = report["pids"]
                elif "exit" in report:
                    self.status[report["pid"]] = report["exit"]
                self.lock.notify_all()
        with self.lock:
            self.ended = True
            self.lock.notify_all()


# --- the interpreter's side ---------------------------------------------------------------------------------


def serve(reports_fd: int) -> None:
    """Import PRELOAD, then fork a child for each request read from stdin; report pids and exit codes."""
    from train.config.entry import quiet_library_warnings

    quiet_library_warnings()
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    _warm_up()
    preloaded = [name for name in NOT_PRELOADED if name in sys.modules]
    assert not preloaded, f"the warm interpreter imported {preloaded}, whose settings the environment gives"
    reports = os.fdopen(reports_fd, "w", buffering=1)
    children: dict[int, int] = {}  # pid → request id
    stdin = sys.stdin.fileno()
    while True:
        readable, _, _ = select.select([stdin], [], [], 0.05)
        _reap(children, reports)
        if not readable:
            continue
        line = sys.stdin.readline()
        if not line:
            break
        request = json.loads(line)
        if request["op"] == "quit":
            break
        sys.stdout.flush()
        sys.stderr.flush()
        pids = _fork(request, reports_fd)
        children.update({pid: request["id"] for pid in pids})
        reports.write(json.dumps({"id": request["id"], "pids": pids}) + "\n")
    for pid in list(children):
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _warm_up() -> None:
    """PRELOAD_IF_PRESENT's imports, DeepSpeed's op probe and the GPT-2 BPE (see PRELOAD_IF_PRESENT)."""
    import importlib

    import torch

    if torch.version.cuda is not None or torch.version.hip is not None:
        return
    for name in PRELOAD_IF_PRESENT:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    try:  # (a failure here is the run's to meet and report, as without the warm-up)
        import deepspeed.ops

        getattr(deepspeed.ops, "__compatible_ops__", None)
        from train.data.tokenizer import gpt2

        gpt2()
    except Exception:
        pass


def _reap(children: dict, reports) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        children.pop(pid, None)
        reports.write(json.dumps({"pid": pid, "exit": os.waitstatus_to_exitcode(status)}) + "\n")


def _fork(request: dict, reports_fd: int) -> list[int]:
    ranks = request.get("ranks") or request.get("world") or 0
    pids = []
    for rank in range(max(ranks, 1)):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                _child_setup(request, reports_fd, rank if ranks else None)
                code = _call(request, rank) if request["op"] == "call" else _run(request)
            except SystemExit as exit_:
                code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
            except BaseException:  # what python -m prints for an uncaught exception, and its exit code
                traceback.print_exc()
                code = 1
            finally:
                for stream in (sys.stdout, sys.stderr):
                    try:
                        stream.flush()
                    except Exception:  # a closed stream: nothing left to write
                        pass
                os._exit(code)
        pids.append(pid)
    return pids


def _child_setup(request: dict, reports_fd: int, rank: int | None) -> None:
    """A new session, the request's environment, folder and output files, default signal handling."""
    os.setsid()
    os.close(reports_fd)
    for number in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD, signal.SIGPIPE):
        signal.signal(number, signal.default_int_handler if number == signal.SIGINT else signal.SIG_DFL)
    env = dict(request["env"])
    if rank is not None:
        world = request.get("ranks") or request["world"]
        env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(request["port"]), GROUP_RANK="0")
    os.environ.clear()
    os.environ.update(env)
    os.chdir(request.get("cwd") or REPO)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    for fd, path in ((1, request.get("out")), (2, request.get("err"))):
        path = path.format(rank=rank) if path and rank is not None else path
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND) if path else os.open(os.devnull, os.O_WRONLY)
        os.dup2(target, fd)
        os.close(target)
    sys.stdin = open(0, "r", closefd=False)
    sys.stdout = io.TextIOWrapper(open(1, "wb", buffering=0, closefd=False), line_buffering=True,
                                  write_through=bool(env.get("PYTHONUNBUFFERED")))
    sys.stderr = io.TextIOWrapper(open(2, "wb", buffering=0, closefd=False), line_buffering=True, write_through=True)


def _run(request: dict) -> int:
    """`python -m module args`, in this process."""
    import runpy

    module, *args = request["argv"]
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
    return 0


def _call(request: dict, rank: int) -> int:
    """One gloo rank of distributed.run_distributed: the function called, its result saved."""
    import importlib.util
    import pickle
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    folder = str(Path(request["file"]).parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    module = sys.modules.get(request["module"])
    if module is None or getattr(module, "__file__", None) != request["file"]:
        spec = importlib.util.spec_from_file_location(request["module"], request["file"])
        module = importlib.util.module_from_spec(spec)
        sys.modules[request["module"]] = module
        spec.loader.exec_module(module)
    fn = module
    for part in request["qualname"].split("."):
        fn = getattr(fn, part)
    with open(request["args"], "rb") as f:
        args = pickle.load(f)
    torch.set_num_threads(request["threads"])
    dist.init_process_group("gloo", rank=rank, world_size=request["world"],
                            timeout=timedelta(seconds=request["timeout"]))
    try:
        result = fn(*args)
        torch.save(result, Path(request["results"]) / f"rank{rank}.pt")
        dist.barrier()  # every rank done before any tears down
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0
