"""Layout-neutral, verified checkpoints (manager.py), the state parts a run registers (parts.py), the
resume checks (resume_checks.py) and Hugging Face import/export (hugging_face.py)."""

from train.checkpoint.manager import (
    CheckpointError,
    check_model,
    checkpoint_dir,
    find_resume_path,
    layout_of,
    load,
    read_model_weights,
    save,
    saved_model_config,
    tag_folder,
)

__all__ = [
    "CheckpointError", "check_model", "checkpoint_dir", "find_resume_path", "layout_of", "load",
    "read_model_weights", "save", "saved_model_config", "tag_folder",
]
