"""What a piece of PyTorch code asks of a GPU, counted without one: every operator it dispatches, on fake
tensors, with the kernels it would launch, the bytes they move, their FLOPs, the source line that asked,
and every device→host read.

Used inside torch's FakeTensorMode (tensors with shapes, dtypes and strides but no storage, so a
gpt3-125m step at its real shape costs seconds on a laptop), an `OpLedger` sees each aten operator
below autograd, as the GPU's stream would receive it, and keeps one `Op` for it:

  kind      query (a tensor's metadata, dispatched only because the tensors are fake, or a profiler's mark: nothing
            on a GPU), view (an alias, _unsafe_view too: no kernel), alloc (empty memory, or a Python number wrapped
            as a 0-d host tensor: no kernel), gemm (a matrix product), attention (gpt3d's attention ops:
            model/attention_op.py), loss (gpt3d's loss rows: model/loss_kernel.py), multi_tensor (torch's _foreach_*
            and fused optimizer kernels), collective (c10d), memory (every other kernel: elementwise, reductions,
            copies, gathers), read (a device→host read: `.item()`, `float()`, `int()`, `bool()` and `.tolist()` of a
            device tensor, a synchronize), late read (a read of a tensor an earlier step made: it waits for that
            step's work only)
  kernels   launches on a CUDA GPU: 1, but multi_tensor (chunks of 65,536 elements, at most 320 chunks and a
            few dozen tensors a launch, as torch's multi_tensor_apply packs them) and the kernel counts of the
            custom ops (their `kernels` in LAUNCHES)
  bytes     read + written: each input's elements once (a broadcast dimension read once), each output's
            written once; an in-place operator reads and writes what it mutates (its schema's `Tensor(a!)`
            arguments: the first of `add_`, every tensor of `_foreach_add_`); `copy_`, `fill_` and `zero_`
            only write it
  flops     torch.utils.flop_counter's count for the matrix products; the attention ops' from their band
  where     the innermost line of gpt3d, DeepSpeed or torch.optim whose call reached the operator; in
            backward, for operators autograd runs for a forward one, that forward line (anomaly mode
            keeps it), marked "(backward)"

A read is counted when its tensor is fake, i.e. on the device: tensors that were real before the ledger
began (a batch in host memory, torch's host-side step counters) are host memory and reading them waits
for nothing. The read's value is made up (False, 0 or 1.0), as a step without faults would read: the code
goes on along its usual path. `torch.cuda.synchronize` and DeepSpeed's
accelerator synchronize count as reads too.
"""

from __future__ import annotations

import functools
import math
import sys
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

REPO = Path(__file__).resolve().parents[1]
SITE_PACKAGES = Path(torch.__file__).resolve().parents[1]
CHUNK_ELEMENTS = 65536  # torch's multi_tensor_apply: elements per chunk
CHUNKS_PER_LAUNCH = 320  # and chunks (thread blocks) per launch
TENSORS_PER_LAUNCH = {1: 110, 2: 64, 3: 48, 4: 36, 5: 30}  # and tensors per launch, by lists (depth)
# Kernels a custom op launches on a GPU: the attention forward is one kernel; its backward a
# preprocess, the key-block kernel and the dQ pass (a cast, or the deterministic kernel).
LAUNCHES = {"gpt3d::attention": 1, "gpt3d::attention_backward": 3}
WRITE_ONLY = {"copy_", "fill_", "zero_", "normal_", "uniform_", "random_", "bernoulli_", "exponential_"}
# Operators that launch no kernel: allocations, bookkeeping, and _unsafe_view (a view of a tensor its caller just made,
# as matmul and reshape return theirs; its schema declares no alias, so _is_view does not see it)
NO_KERNEL = {"empty", "empty_strided", "new_empty", "new_empty_strided", "empty_like", "lift_fresh", "record_stream",
             "set_", "resize_", "_unsafe_view"}
GEMMS = {"mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "_addmm_activation"}
LOCATIONS = ("model", "parallel", "train")  # gpt3d's own code, where a line is named in the bill
PLUMBING = ("torch/nn/modules/", "torch/nn/functional.py", "torch/_tensor.py", "torch/autograd/", "torch/utils/",
            "torch/_ops.py", "torch/_library/", "torch/overrides.py", "torch/_compile.py", "torch/_dynamo/",
            "torch/amp/", "torch/_prims_common/", "torch/_refs/", "torch/_decomp/", "torch/_subclasses/",
            "torch/functional.py", "torch/_jit_internal.py", "torch/library.py", "deepspeed/utils/nvtx.py")
PASS_THROUGH = ("train/runtime/late_read.py",)  # gpt3d's own plumbing: its caller is named instead


@dataclass
class Op:
    """One dispatched operator (see the module docstring)."""

    name: str  # aten::mm, gpt3d::attention, ...
    kind: str
    kernels: int
    bytes: float
    flops: float
    where: str
    gemm: tuple[int, int, int] | None = None  # (M, N, K) of a matrix product
    dtype: str = ""  # the output's (a product's: its inputs')
    detail: dict = field(default_factory=dict)  # what a custom op's cost needs (attention: head dim, band)


class OpLedger(TorchDispatchMode):
    """Records an `Op` for every operator dispatched while it is the innermost mode (see the module docstring)."""

    def __init__(self):
        super().__init__()
        self.ops: list[Op] = []
        self.recording = False  # answers reads with made-up values always; records while True
        self._quiet = 0  # > 0 inside a read already recorded whole (tolist: its unbind and reads are the read)
        self._made = weakref.WeakValueDictionary()  # id → a tensor the recorded operators made

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name.split("::")[-1]
        if name == "_local_scalar_dense":
            tensor = args[0]
            if isinstance(tensor, FakeTensor) and not self._quiet:
                self.read(func._schema.name, tensor)
            return _made_up(tensor) if isinstance(tensor, FakeTensor) else func(*args, **kwargs)
        out = func(*args, **kwargs)
        if self.recording and not self._quiet:
            self.ops.append(describe(func, args, kwargs, out))
            self._made.update({id(t): t for t in tree_flatten(out)[0] if isinstance(t, FakeTensor)})
        return out

    def read(self, what: str, tensor: torch.Tensor | None = None) -> None:
        """A device→host read of `tensor` (None: a synchronize): "late read" when the tensor was made before the
        recording began (by an earlier step), which waits only for that step's work, not for everything queued."""
        if self.recording:
            late = tensor is not None and self._made.get(id(tensor)) is not tensor
            self.ops.append(Op(what, "late read" if late else "read", 0, 0.0, 0.0, where(3)))

    @contextmanager
    def reading_hooks(self):
        """Also count `.tolist()` of a device tensor as one read (not one per element) and every synchronize."""
        from deepspeed.accelerator import get_accelerator

        ledger, tolist, accelerator = self, FakeTensor.tolist, get_accelerator()
        synchronize, cuda_synchronize = accelerator.synchronize, torch.cuda.synchronize

        def counted_tolist(tensor):
            if not ledger._quiet:  # a row's tolist inside a tolist is part of the one read
                ledger.read("Tensor.tolist", tensor)
            ledger._quiet += 1
            try:
                return tolist(tensor)
            finally:
                ledger._quiet -= 1

        def counted_synchronize(*args, **kwargs):
            ledger.read("synchronize")

        FakeTensor.tolist = counted_tolist
        accelerator.synchronize, torch.cuda.synchronize = counted_synchronize, counted_synchronize
        try:
            yield self
        finally:
            FakeTensor.tolist = tolist
            accelerator.synchronize, torch.cuda.synchronize = synchronize, cuda_synchronize


def _made_up(tensor: torch.Tensor):
    """What a read of a fault-free step returns: False, 0 or 1.0 (a flag not set, a finite nonzero number)."""
    if tensor.dtype == torch.bool:
        return False
    return 1.0 if tensor.dtype.is_floating_point else 0


def describe(func, args, kwargs, out) -> Op:
    """The `Op` of one dispatched operator and its result."""
    schema = func._schema
    namespace, name = schema.name.split("::")
    full = f"{namespace}::{name}"
    site = where()
    outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
    dtype = str(outputs[0].dtype).removeprefix("torch.") if outputs else ""
    if namespace in ("prim", "profiler") or name.startswith("sym_"):  # metadata, a profiler's mark: nothing on a GPU
        return Op(full, "query", 0, 0.0, 0.0, site, dtype=dtype)
    if name == "scalar_tensor":  # a Python number made a 0-d host tensor ("wrapped number"): no GPU kernel
        return Op(full, "alloc", 0, 0.0, 0.0, site, dtype=dtype)
    if _is_view(schema) or name in NO_KERNEL:
        return Op(full, "alloc" if name.startswith(("empty", "new_empty")) else "view", 0, 0.0, 0.0, site, dtype=dtype)
    written = {id(t) for t in tree_flatten(kwargs.get("out"))[0] if isinstance(t, torch.Tensor)}
    inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor) and id(t) not in written]
    if name in WRITE_ONLY and inputs and inputs[0] is args[0]:
        inputs = inputs[1:]
    returned = {id(t) for t in outputs}
    mutated = [t for t in tree_flatten(_mutated_args(schema, args, kwargs))[0]
               if isinstance(t, torch.Tensor) and id(t) not in returned]  # written in place, not returned
    moved = float(sum(touched_bytes(t) for t in (*inputs, *outputs, *mutated)))
    if namespace == "gpt3d":
        return _custom(full, name, args, site, moved, dtype)
    if name in GEMMS:
        return Op(full, "gemm", 1, moved, _flops(func, args, kwargs, out), site, _mnk(name, args),
                  dtype=str(args[1 if name in ("addmm", "baddbmm", "_addmm_activation") else 0].dtype).removeprefix("torch."))
    if name.startswith("_foreach_") or name.startswith("_fused_"):
        return Op(full, "multi_tensor", multi_tensor_launches(name, args), moved, 0.0, site, dtype=dtype)
    if namespace in ("c10d", "_c10d_functional"):
        return Op(full, "collective", 1, moved, 0.0, site, dtype=dtype)
    return Op(full, "memory", 1, moved, 0.0, site, dtype=dtype)


def _mutated_args(schema, args, kwargs) -> list:
    """The arguments the operator writes in place (`Tensor(a!)` in its schema: in-place ops, foreach ops,
    custom ops that mutate)."""
    return [args[i] if i < len(args) else kwargs.get(a.name) for i, a in enumerate(schema.arguments)
            if a.alias_info is not None and a.alias_info.is_write]


def _is_view(schema) -> bool:
    """An operator whose output aliases an input without writing it: a view, no kernel."""
    return any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)


def touched_bytes(t: torch.Tensor) -> int:
    """Bytes an operator reads (or writes) of t: its elements, a broadcast (stride-0) dimension once."""
    return math.prod(s for s, st in zip(t.shape, t.stride()) if st != 0) * t.element_size()


def _flops(func, args, kwargs, out) -> float:
    from torch.utils.flop_counter import flop_registry

    count = flop_registry.get(func._overloadpacket)
    return float(count(*args, **kwargs, out_val=out)) if count is not None else 0.0


def _mnk(name: str, args) -> tuple[int, int, int]:
    """(M, N, K) of a product: M×K times K×N (a batched product's batch folded into M)."""
    a, b = (args[1], args[2]) if name in ("addmm", "baddbmm", "_addmm_activation") else (args[0], args[1])
    batch = a.shape[0] if a.dim() == 3 else 1
    return batch * a.shape[-2], b.shape[-1], a.shape[-1]


def multi_tensor_launches(name: str, args) -> int:
    """Kernel launches of a multi-tensor operator on CUDA: its tensors packed into launches of at most
    TENSORS_PER_LAUNCH[depth] tensors and CHUNKS_PER_LAUNCH chunks of CHUNK_ELEMENTS (`_foreach_norm` also
    launches one clean-up kernel)."""
    lists = [a for a in args if isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor)]
    if not lists:
        return 1
    per_launch = TENSORS_PER_LAUNCH[min(len(lists), 5)]
    launches, tensors, chunks = 1, 0, 0
    for t in lists[0]:
        for _ in range(max(1, math.ceil(t.numel() / CHUNK_ELEMENTS))):
            if tensors == per_launch or chunks == CHUNKS_PER_LAUNCH:
                launches, tensors, chunks = launches + 1, 0, 0
            chunks += 1
        tensors += 1
    return launches + (1 if name.startswith("_foreach_norm") else 0)


def _custom(full: str, name: str, args, site: str, moved: float, dtype: str) -> Op:
    """gpt3d's custom ops: the attention's FLOPs from its band (its score and value products, QKᵀ and PV,
    forward; the backward's five products, S, dP, dV, dK and dQ, 2.5 times the forward's), a loss kernel's
    bytes as counted."""
    if name in ("attention", "attention_backward"):
        qkv, head_dim = args[0], args[4 if name == "attention_backward" else 1]
        lo, hi = args[5 if name == "attention_backward" else 2], args[6 if name == "attention_backward" else 3]
        b, t, width = qkv.shape
        heads = width // (3 * head_dim)
        pairs = visible_pairs(t, lo, hi)
        forward = 4.0 * b * heads * head_dim * pairs
        flops = 2.5 * forward if name == "attention_backward" else forward
        detail = {"head_dim": head_dim, "backward": name == "attention_backward"}
        return Op(full, "attention", LAUNCHES[full], moved, flops, site, dtype=dtype, detail=detail)
    if name in ("float8_cast", "float8_scales"):  # model/float8.py: one elementwise kernel each
        return Op(full, "memory", 1, moved, 0.0, site, dtype=dtype)
    return Op(full, "loss", LAUNCHES.get(full, 1), moved, 0.0, site, dtype=dtype)


def visible_pairs(t: int, lo: int, hi: int) -> int:
    """Query-key pairs (i, j) of a length-t sequence with lo ≤ j − i ≤ hi."""
    return sum(max(0, min(t - 1, i + hi) - max(0, i + lo) + 1) for i in range(t))


def where(skip: int = 2) -> str:
    """The source line that asked for the operator now dispatching (see the module docstring); `skip`: the
    frames of the ledger itself."""
    frame = sys._getframe(skip)
    inner_to_engine = []
    while frame is not None:
        path = frame.f_code.co_filename
        if path.endswith("torch/autograd/graph.py"):  # autograd's engine runs below: backward ops
            break
        inner_to_engine.append(frame)
        frame = frame.f_back
    else:
        return _first_named(inner_to_engine) or "?"
    named = _first_named(inner_to_engine)  # a Python backward or a gradient hook (DeepSpeed's)
    if named is not None:
        return named
    node = torch._C._current_autograd_node()
    trace = node.metadata.get("traceback_") if node is not None else None
    forward = _named_in_traceback(trace) if trace else None
    return f"{forward} (backward)" if forward else f"autograd {node.name() if node is not None else '?'}"


def _first_named(frames) -> str | None:
    for frame in frames:
        name = _name(frame.f_code.co_filename, frame.f_lineno)
        if name is not None:
            return name
    return None


def _name(path: str, line: int) -> str | None:
    """"model/fused_loss.py:95", "deepspeed/runtime/bf16_optimizer.py:402", "torch/optim/adam.py:528", or
    None for a frame of plumbing (torch's own modules, autograd, the dispatcher, this ledger)."""
    relative = _relative(path)
    return None if relative is None else f"{relative}:{line}"


@functools.lru_cache(maxsize=None)
def _relative(path: str) -> str | None:
    """A named file's path as the bill prints it, or None (see `_name`)."""
    file = Path(path).resolve()
    if file.is_relative_to(SITE_PACKAGES):  # first: a virtual environment may live inside the repository
        relative = file.relative_to(SITE_PACKAGES).as_posix()
        named = relative.startswith(("deepspeed/", "torch/optim/", "torch/distributed/"))
        return relative if named and not relative.startswith(PLUMBING) else None
    if file.is_relative_to(REPO):
        relative = file.relative_to(REPO).as_posix()
        return relative if relative.split("/")[0] in LOCATIONS and relative not in PASS_THROUGH else None
    return None


def _named_in_traceback(trace: list[str]) -> str | None:
    """The innermost named line of an anomaly-mode traceback (formatted frames, outermost first)."""
    for entry in reversed(trace):
        first = entry.strip().splitlines()[0]  # File "...", line N, in f
        if not first.startswith("File "):
            continue
        path = first.split('"')[1]
        line = int(first.split(", line ")[1].split(",")[0])
        name = _name(path, line)
        if name is not None:
            return name
    return None
