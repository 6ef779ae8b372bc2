"""Tensors of a checkpoint as slices of full tensors, written and read by torch.distributed.checkpoint.

Every tensor a rank saves is a region of a full-model tensor: a tensor-parallel shard of a weight
(parallel/naming.py's Shard: `local[local_index] == full[index]`), or the same region of its Adam
moments. `FullSlice` tells DCP exactly that (DCP's checkpointable protocol: one chunk at `offsets`
of a tensor of `full_shape`), so DCP stores each chunk once with its offsets, and a reader at any
other layout asks for the regions it needs: DCP reads the overlapping parts of whichever chunks
hold them (resharding). The vocabulary padding of a tp shard is no part of the full tensor and is
never saved.

Storage is DCP's Hugging Face safetensors backend in its distributed mode: each rank writes one
`shard-<rank+1>-model-00001-of-00001.safetensors` whose header carries, as JSON, the offsets of
every chunk in it. Reading rebuilds DCP's metadata from those headers alone. Nothing on either side
is pickled (DCP's default file system backend would pickle its `.metadata` file, and reading that
would unpickle; the safetensors backend writes no such file).

torch.distributed.checkpoint takes most of a second to import, so this module is imported only where a
checkpoint is written, read or its tensors verified (saving.py, loading.py, integrity.py), never when a
command starts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from train.checkpoint.safetensors_header import read_header
from train.checkpoint.schema import sharding_problem
from train.checkpoint.tiling import tiling_problem

SHARDING_KEY = "DCP_SHARDING_INFO"  # DCP's safetensors backend: {tensor: {"saved_offsets": [...]}} per file

if not hasattr(dcp, "HuggingFaceStorageReader"):
    raise ImportError(f"gpt3d's checkpoints need PyTorch 2.9 or newer (torch.distributed.checkpoint's safetensors "
                      f"storage); this is PyTorch {torch.__version__}")


@dataclass
class FullSlice:
    """`tensor` is the region of a (full_shape) tensor that starts at `offsets` (its size is the
    tensor's). Saved, it is one chunk of that full tensor; loaded, DCP fills it from whatever chunks
    were saved, at whatever layout."""

    tensor: torch.Tensor
    full_shape: tuple[int, ...]
    offsets: tuple[int, ...]

    def size(self) -> torch.Size:
        return torch.Size(self.full_shape)

    def _chunk(self) -> ChunkStorageMetadata:
        return ChunkStorageMetadata(offsets=torch.Size(self.offsets), sizes=self.tensor.shape)

    # DCP's checkpointable protocol (what DTensor implements)
    def __create_write_items__(self, fqn: str, obj) -> list[WriteItem]:
        return [WriteItem(
            index=MetadataIndex(fqn, torch.Size(self.offsets)),
            type=WriteItemType.SHARD,
            tensor_data=TensorWriteData(chunk=self._chunk(), properties=TensorProperties.create_from_tensor(self.tensor),
                                        size=self.size()),
        )]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [self._chunk()]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        return self.tensor


def region(index: tuple[slice, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(offsets, sizes) of a region given as one slice per dimension."""
    return tuple(s.start for s in index), tuple(s.stop - s.start for s in index)


def is_empty(index: tuple[slice, ...]) -> bool:
    """A region with no element: a tp shard that is vocabulary padding only."""
    return any(s.stop <= s.start for s in index)


class _SlicePlanner(DefaultSavePlanner):
    """DCP's planner over a flat {name: FullSlice}, finding a slice's data through the protocol (the
    default looks up tensors only)."""

    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def lookup_object(self, index: MetadataIndex):
        return self.state_dict[index.fqn].__get_tensor_shard__(index)


class _SliceLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner over a flat {name: FullSlice or full-size tensor}. Its set-up skips the
    default's pass over the values, which knows tensors only and would drop the slices."""

    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        self.original_state_dict = self.state_dict = state_dict
        self.metadata, self.is_coordinator = metadata, is_coordinator

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        obj = self.state_dict[index.fqn]
        return obj.__get_tensor_shard__(index) if isinstance(obj, FullSlice) else obj


class ShardReader(dcp.HuggingFaceStorageReader):
    """DCP's safetensors reader, its metadata (every file's header) read once for many loads."""

    def __init__(self, folder: Path):
        super().__init__(str(folder))
        self._metadata = None

    def read_metadata(self, *args, **kwargs):
        if self._metadata is None:
            self._metadata = super().read_metadata()
        return self._metadata



def write(slices: dict[str, FullSlice], folder: Path, distributed: bool = True, group=None) -> None:
    """Every rank's slices into `folder` (a collective over `group` when distributed, the default
    process group when None): one safetensors file per rank that holds any, each fsynced."""
    writer = dcp.HuggingFaceStorageWriter(str(folder), save_distributed=True)
    dcp.save(slices, storage_writer=writer, planner=_SlicePlanner(), no_dist=not distributed, process_group=group)


def read(requests: dict, reader: ShardReader, distributed: bool = True) -> None:
    """Fill each request (a FullSlice, or a plain tensor of the full shape) from the checkpoint
    (a collective when distributed: every rank calls it, with its own requests, maybe none)."""
    dcp.load(requests, storage_reader=reader, planner=_SliceLoadPlanner(), no_dist=not distributed)


def layout_problems(folder: Path, shard_files: list[str], expected: dict[str, tuple[int, ...]]) -> list[str]:
    """What is wrong with the tensors the safetensors files of `folder` hold, from their headers alone
    (no tensor data is read): each file's header is well-formed and has a sharding entry for every
    tensor in it, every tensor of `expected` {name: full shape} is there, fp32, and its chunks tile
    its full shape exactly once, and nothing else is saved. Empty: DCP may read them."""
    chunks: dict[str, list] = {}
    for file in shard_files:
        try:
            entries, metadata = read_header(Path(folder) / file)
        except (OSError, ValueError) as err:
            return [str(err)]
        try:
            info = json.loads(metadata.get(SHARDING_KEY, "null"))
        except ValueError:
            return [f"{file}: its {SHARDING_KEY} is not JSON"]
        problem = sharding_problem(info, sorted(entries), file)
        if problem:
            return [problem]
        for name, entry in entries.items():
            if entry.dtype != "F32":
                return [f"{file}: {name} is {entry.dtype}; a checkpoint holds F32 (fp32) tensors only"]
            offsets = tuple(info[name]["saved_offsets"])
            chunks.setdefault(name, []).append((offsets, entry.shape))
    problems = [f"{name}: not saved" for name in expected if name not in chunks]
    problems += [f"{name}: saved, but no part of this model" for name in sorted(set(chunks) - set(expected))]
    for name, shape in expected.items():
        problem = tiling_problem(shape, chunks.get(name, [])) if name in chunks else None
        if problem:
            problems.append(f"{name} (shape {list(shape)}): {problem}")
    return problems
