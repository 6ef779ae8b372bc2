"""torchao's float8 pieces that model/float8.py is built from (the `fp8` extra: pip install -e ".[fp8]").

Importing torchao loads its compiled kernels, and on a machine without the GPU those are built for it
logs one warning per kernel library it cannot load, and torch one about an enum torchao registers;
none of it concerns float8 training, so those loggers are held at ERROR while torchao is imported.
"""

from __future__ import annotations

import contextlib
import logging

_NOISY_AT_IMPORT = ("torchao", "torch.utils._pytree")


@contextlib.contextmanager
def _quiet_import():
    loggers = [logging.getLogger(name) for name in _NOISY_AT_IMPORT]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


with _quiet_import():
    from torchao.float8.config import Float8LinearConfig, ScalingGranularity
    from torchao.float8.float8_ops import addmm_float8_unwrapped
    from torchao.float8.float8_utils import amax_to_scale, to_fp8_saturated

__all__ = [
    "Float8LinearConfig", "ScalingGranularity", "addmm_float8_unwrapped", "amax_to_scale", "to_fp8_saturated",
]
