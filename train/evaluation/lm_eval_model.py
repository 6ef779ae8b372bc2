"""gpt3d as an lm-evaluation-harness model, named "gpt3d", at any layout.

    python -m train.harness --model gpt3d --model_args checkpoint=runs/toy/.../checkpoints --tasks lambada_openai
    torchrun --nproc_per_node 4 -m train.harness --model gpt3d --model_args checkpoint=...,tp=2,pp=2 --tasks hellaswag

    import lm_eval, train.evaluation.lm_eval_model                     # the import registers "gpt3d"
    lm_eval.simple_evaluate(model="gpt3d", model_args="checkpoint=...", tasks=["piqa"])

Model arguments: checkpoint (a run directory, its checkpoints/ folder or one step folder; the model
shape is the checkpoint's own), tp and pp (the layout; dp is what the launch's world size leaves),
batch_tokens (input tokens per forward pass), device (auto, cpu, cuda), precision (auto, fp32, bf16),
seed, max_gen_toks (lm-eval's --device: cuda:N is cuda, each rank taking its own GPU; a GPU where none
is visible falls back to the CPU, as for lm-eval's hf model). lm-eval's batch_size is not used: requests are batched by length up to
batch_tokens instead.

  loglikelihood          lm-eval splits each (context, continuation) into tokens (TemplateLM); the
                         requests go through gpt3d's scorer (train/evaluation/scorer.py): batched by
                         length, a context shared by several continuations encoded once, left-truncated
                         to model.seq_len as lm-eval's hf model does (counted, and logged once)
  loglikelihood_rolling  a document as lm-eval's disjoint rolling windows of model.seq_len tokens after
                         <|endoftext|>, each window a request of the same scorer; their sum
  generate_until         decoding with the KV cache (parallel.layout_decoder.LayoutDecoder), requests with
                         equal context lengths and settings in one batch, greedy unless do_sample;
                         the text is cut at the first stop sequence (<|endoftext|> among them)

Every rank of the layout runs the harness on the same requests: like lm-eval's Megatron model, the
model reports rank 0 of a world of 1 (so lm-eval neither splits the documents nor gathers them;
only LOCAL_RANK 0 writes results), and data-parallel replicas split the scoring batches inside the
scorer.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text

from model import GPTConfig
from model.decoding import generate
from train.data.tokenizer import EOT, gpt2
from train.evaluation.requests import fit
from train.evaluation.scorer import score_requests

log = logging.getLogger(__name__)


def _device_setting(device: str | None) -> str:
    """lm-eval's --device (default cuda:0, as for its hf model) as gpt3d's device setting: each rank of a
    layout takes its own GPU, so cuda:N is cuda; a GPU asked for where none is visible falls back to auto
    (the CPU), as lm-eval's hf model does."""
    if device is None or (device.startswith("cuda") and not torch.cuda.is_available()):
        return "auto"
    return "cuda" if device.startswith("cuda") else device


@register_model("gpt3d")
class GPT3DLM(TemplateLM):
    """See the module docstring."""

    def __init__(self, checkpoint: str, tp: int = 1, pp: int = 1, batch_tokens: int = 8192, device: str = "auto",
                 precision: str = "auto", seed: int = 1234, max_gen_toks: int = 256, batch_size=None,
                 max_batch_size=None, **_lm_eval_settings):
        super().__init__()
        from train.checkpoint import read_model_weights, saved_model_config, tag_folder
        from train.checkpoint.model_part import model_part
        from train.config.sections.train import TrainConfig
        from train.runtime.resolve import resolve_runtime

        folder = tag_folder(Path(checkpoint))
        self.config = GPTConfig.from_dict(saved_model_config(folder))
        runtime = resolve_runtime(TrainConfig(device=_device_setting(device), precision=precision))
        self._device = runtime.device
        self.part, self.topology = model_part(read_model_weights(folder, self.config), self.config, int(tp), int(pp),
                                              runtime, int(seed))
        self.bf16 = runtime.bf16_products
        self.batch_tokens, self.seed, self._max_gen_toks = int(batch_tokens), int(seed), int(max_gen_toks)
        self.truncated = 0  # requests cut to model.seq_len so far

    @property
    def eot_token_id(self) -> int:
        return EOT

    @property
    def max_length(self) -> int:
        return self.config.seq_len

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def tokenizer_name(self) -> str:
        return "gpt2"

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return gpt2().encode_ordinary(string)

    def tok_decode(self, tokens) -> str:
        return gpt2().decode(list(tokens))

    def _score(self, pairs) -> list[tuple[float, bool]]:
        """(context ids, continuation ids) pairs → (log-likelihood, greedy), cut to the window as lm-eval's hf does."""
        requests = []
        for context, continuation in pairs:
            request, cut = fit(tuple(context) or (EOT,), tuple(continuation), self.config.seq_len)
            requests.append(request)
            self.truncated += cut
            if cut and self.truncated == 1:
                log.warning("a request is longer than model.seq_len=%d: its context is truncated from the left "
                            "(and so are later ones, counted in .truncated)", self.config.seq_len)
        scores = score_requests(self.part, self.config, self.topology, requests, self.batch_tokens, self.bf16)
        return [(s.logprob, s.greedy) for s in scores]

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        results = self._score([(context, continuation) for _, context, continuation in requests])
        for (text, _, _), answer in zip(requests, results):
            if text is not None:
                self.cache_hook.add_partial("loglikelihood", text, answer)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows, owners = [], []
        for number, request in enumerate(requests):
            tokens = self.tok_encode(request.args[0])
            for window in lm_utils.get_rolling_token_windows(tokens, EOT, self.config.seq_len, context_len=1):
                windows.append(lm_utils.make_disjoint_window(window))
                owners.append(number)
        totals = [0.0] * len(requests)
        for owner, (logprob, _) in zip(owners, self._score(windows)):
            totals[owner] += logprob
        for request, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        from parallel.layout_decoder import LayoutDecoder

        groups: dict[tuple[int, str], list[int]] = {}
        prompts, settings = [], []
        for number, request in enumerate(requests):
            context, gen_kwargs = request.args
            kwargs = normalize_gen_kwargs(dict(gen_kwargs), self.max_gen_toks)
            room = max(self.config.seq_len - kwargs["max_gen_toks"], 1)
            prompts.append(self.tok_encode(context)[-room:] or [EOT])
            settings.append(kwargs)
            groups.setdefault((len(prompts[-1]), json.dumps(kwargs, sort_keys=True, default=str)), []).append(number)
        texts = [""] * len(requests)
        decoder = LayoutDecoder(self.part, self.config, self.topology)
        generator = torch.Generator(device=self._device).manual_seed(self.seed)
        was_training = self.part.training
        self.part.eval()
        for numbers in groups.values():
            kwargs = settings[numbers[0]]
            temperature = kwargs["temperature"] if kwargs["do_sample"] else 0.0
            idx = torch.tensor([prompts[n] for n in numbers], device=self._device)  # (B, T0)
            with torch.autocast(self._device.type, dtype=torch.bfloat16, enabled=self.bf16):
                out = generate(decoder, idx, kwargs["max_gen_toks"], temperature, None, generator)  # (B, T0 + new)
            stop = handle_stop_sequences(kwargs["until"], eos=self.tok_decode([EOT]))
            for n, tokens in zip(numbers, out[:, idx.shape[1]:].tolist()):
                texts[n] = postprocess_generated_text(self.tok_decode(tokens), stop, None)
                self.cache_hook.add_partial("generate_until", requests[n].args, texts[n])
        self.part.train(was_training)
        return texts
