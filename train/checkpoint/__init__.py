"""Layout-neutral, verified checkpoints. What the rest of gpt3d uses, from one place:

- a run's checkpoints: `Checkpointer` (checkpointer.py) with its `CheckpointSettings`, and the parts
  a run registers (parts.py, rng.py, kernels.py);
- finding and verifying one (integrity.py), loading the whole model's weights in one process
  (loading.py), saving once (saving.py); a save the disk refused (storage.py: StorageError);
- Hugging Face import (hugging_face.py; export is `python -m train.export`);
- the checkpoint a resume starts from, chosen and verified once (resume_point.py), and a trained
  model's part at any layout, built from a checkpoint (model_part.py).
"""

from train.checkpoint.checkpointer import Checkpointer, CheckpointSettings
from train.checkpoint.files import CheckpointError, checkpoint_dir
from train.checkpoint.hugging_face import read_init_weights
from train.checkpoint.integrity import check_model, find_resume_path, model_differences, tag_folder
from train.checkpoint.kernels import KernelChoices
from train.checkpoint.loading import read_model_weights, saved_model_config
from train.checkpoint.parts import CheckpointParts, EngineCounters, Keyed, Record
from train.checkpoint.rng import ProcessRNG
from train.checkpoint.saving import save
from train.checkpoint.storage import StorageError

__all__ = [
    "CheckpointError", "CheckpointParts", "CheckpointSettings", "Checkpointer", "EngineCounters", "Keyed", "KernelChoices",
    "ProcessRNG", "Record", "StorageError", "check_model", "checkpoint_dir", "find_resume_path", "model_differences",
    "read_init_weights", "read_model_weights", "save", "saved_model_config", "tag_folder",
]
