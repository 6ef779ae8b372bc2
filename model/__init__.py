"""gpt3d's network: single-device PyTorch, no torch.distributed (parallel/ shards it)."""

from model.attention import attention
from model.config import GPTConfig
from model.decoding import Decoder, generate
from model.gpt import GPT, build, count_parameters, flops_per_token, layer_list, make_layer
from model.kv_cache import KVCache

__all__ = [
    "GPT", "GPTConfig", "Decoder", "KVCache", "attention", "build", "count_parameters", "flops_per_token", "generate",
    "layer_list", "make_layer",
]
