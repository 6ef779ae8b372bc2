"""gpt3d's network: single-device PyTorch, no torch.distributed (parallel/ shards it)."""

from model.attention import attention
from model.config import GPTConfig
from model.generate import generate
from model.gpt import GPT, build, count_parameters, layer_list

__all__ = ["GPT", "GPTConfig", "attention", "build", "count_parameters", "generate", "layer_list"]
