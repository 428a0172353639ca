"""The `hf-static` bench method: transformers' own fast path as its documentation gives it,
`generate` with a static cache and torch.compile.

One StaticCache serves every answer of the run, reset before each: a new cache object would be a
new graph input and compile again. transformers compiles the decoding steps itself (not the
prefill) whenever the cache is static and the device is a GPU ("reduce-overhead": CUDA graphs);
on a CPU it does so only when told, which `compile` does here with torch's default mode.
`graphs` counts what dynamo compiled during each answer: after the first, any count is a recompile.
"""

from __future__ import annotations

import time

import torch

from ladechat.engine import kv
from ladechat.errors import UserError

ROUND = 256  # the cache's length is rounded up to this: one length for a whole run


class StaticCacheError(UserError, ValueError):
    pass


def cache_length(prompt_tokens: int, turns: int, max_new_tokens: int, context: int) -> int:
    """A static cache long enough for a conversation of `turns` answers whose questions take
    `prompt_tokens` tokens together: each earlier answer stays in the context, and each turn's
    template adds a few dozen tokens. Rounded up, at most the model's context."""
    need = prompt_tokens + turns * (max_new_tokens + 64)
    return min(-(-need // ROUND) * ROUND, context)


def graphs_compiled() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


class StaticGenerate:
    """HF generate on one pre-allocated static cache, compiled (or not) as transformers does it."""

    def __init__(self, model, length: int, compile: bool) -> None:
        from transformers import StaticCache

        self.model, self.length = model, length
        self.cache = StaticCache(config=model.config, max_cache_len=length)
        self.cache_arg = kv.cache_argument(model)
        self.graphs: list[int] = []  # graphs dynamo compiled during each answer, in order
        if not compile:
            self.options: dict = {"disable_compile": True}
        elif model.device.type == "cuda":
            self.options = {}  # transformers' own default: CompileConfig(), reduce-overhead
        else:
            from transformers import CompileConfig

            config = CompileConfig(mode="default")  # CUDA graphs need a GPU
            config._compile_all_devices = True  # transformers' switch for compiling on a CPU
            self.options = {"compile_config": config}

    def answer(self, ids: list[int], extra: dict, max_new_tokens: int, eos: list[int]) -> tuple[list[int], float]:
        """(the answer's ids, seconds) for the prompt `ids`; `extra`: generate's sampling arguments."""
        if len(ids) + max_new_tokens > self.length:
            raise StaticCacheError(f"hf-static: a prompt of {len(ids)} tokens and {max_new_tokens} new ones do not fit its "
                             f"static cache of {self.length}")
        before = graphs_compiled()
        start = time.perf_counter()
        with torch.inference_mode():
            self.cache.reset()
            ids_t = torch.tensor([ids], device=self.model.device)
            out = self.model.generate(ids_t, attention_mask=torch.ones_like(ids_t), max_new_tokens=max_new_tokens,
                                      eos_token_id=eos or None, pad_token_id=eos[0] if eos else 0,
                                      **{self.cache_arg: self.cache}, **self.options, **extra)
        took = time.perf_counter() - start
        self.graphs.append(graphs_compiled() - before)
        return out[0, len(ids):].tolist(), took

    def report(self) -> dict:
        return {"cache_length": self.length, "graphs_first_answer": self.graphs[0] if self.graphs else 0,
                "recompiles": sum(self.graphs[1:])}
