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
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

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

    def chunks(self) -> dict[str, list[tuple[tuple[int, ...], tuple[int, ...]]]]:
        """{tensor name: [(offsets, sizes) of each saved chunk]}."""
        return {name: [(tuple(c.offsets), tuple(c.sizes)) for c in md.chunks]
                for name, md in self.read_metadata().state_dict_metadata.items()}

    def full_shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: tuple(md.size) for name, md in self.read_metadata().state_dict_metadata.items()}


def write(slices: dict[str, FullSlice], folder: Path, distributed: bool = True) -> None:
    """Every rank's slices into `folder` (a collective when distributed): one safetensors file per
    rank that holds any, each fsynced."""
    writer = dcp.HuggingFaceStorageWriter(str(folder), save_distributed=True)
    dcp.save(slices, storage_writer=writer, planner=_SlicePlanner(), no_dist=not distributed)


def read(requests: dict, reader: ShardReader, distributed: bool = True) -> None:
    """Fill each request (a FullSlice, or a plain tensor of the full shape) from the checkpoint
    (a collective when distributed: every rank calls it, with its own requests, maybe none)."""
    dcp.load(requests, storage_reader=reader, planner=_SliceLoadPlanner(), no_dist=not distributed)


def mismatched(reader: ShardReader, expected: dict[str, tuple[int, ...]]) -> list[str]:
    """What differs between the saved tensors and `expected` {name: full shape}: a tensor missing, of
    another shape, or whose chunks do not add up to the whole (the reader infers a full shape from
    the chunks it finds, so a lost file could otherwise pass as a smaller tensor)."""
    shapes, chunks, problems = reader.full_shapes(), reader.chunks(), []
    for name, shape in expected.items():
        if name not in shapes:
            problems.append(f"{name}: not saved")
        elif shapes[name] != tuple(shape):
            problems.append(f"{name}: saved shape {shapes[name]}, expected {tuple(shape)}")
        elif sum(math.prod(sizes) for _, sizes in chunks[name]) != math.prod(shape):
            problems.append(f"{name}: its saved chunks do not cover it")
    return problems
