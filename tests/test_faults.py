"""Running out of memory or Ctrl-C mid-answer: the session stays consistent, the chat keeps going."""

import io
import re
from dataclasses import replace

import pytest
import torch
from consoles import InterruptedConsole
from rich.console import Console
from test_exactness import hf_greedy
from tiny_models import tiny_model

from ladechat.backends.local import Bot
from ladechat.engine import kv
from ladechat.engine.config import LookaheadConfig, SamplingConfig
from ladechat.engine.decode import Session, generate
from ladechat.engine.events import Done, OutOfMemory, Step
from ladechat.engine.runner import StaticRunner
from ladechat.engine.step_cost import CostModel
from ladechat.settings import Settings
from ladechat.ui.chat import ChatApp

CPU_OOM = RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory: you tried "
                       "to allocate 40000000000000 bytes")


class FailsAfterForward:
    """A model that raises `error` right after its `fail_on_call`-th forward pass has written the KV cache,
    the worst moment: the cache then holds rows of a step that will never be committed. (Ctrl-C raises
    KeyboardInterrupt at the next bytecode after a forward pass, so this is also where it lands.)"""

    def __init__(self, model, fail_on_call: int, error: BaseException) -> None:
        self.model, self.fail_on_call, self.error, self.calls = model, fail_on_call, error, 0
        if hasattr(model, "bind"):  # a model that runs its own steps (engine/models/)
            self.bind = self._bind

    def __getattr__(self, name):
        return getattr(self.model, name)

    def __call__(self, **kwargs):
        return self._counted(self.model(**kwargs))

    def _bind(self, *args, **kwargs):
        """Its prefill and steps, counted as forward passes."""
        steps, counted = self.model.bind(*args, **kwargs), self._counted

        class Failing:
            def __getattr__(self, name):
                return getattr(steps, name)

            def prefill(self, *args):
                return counted(steps.prefill(*args))

            def step(self, *args):
                return counted(steps.step(*args))

        return Failing()

    def _counted(self, out):
        self.calls += 1
        if self.calls == self.fail_on_call:
            raise self.error
        return out


@pytest.mark.parametrize("error", [torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), CPU_OOM,
                                   MemoryError()])
def test_out_of_memory_leaves_the_session_consistent(error):
    model = tiny_model("llama")
    prompt = [5, 17, 23, 5, 17, 23, 5, 17, 9, 40, 41, 42]
    la = LookaheadConfig(window=3, ngram=3, candidates=3)
    session = Session(FailsAfterForward(model, fail_on_call=6, error=error), la)
    partial = []
    with pytest.raises(OutOfMemory, match=r"out of memory on cpu after \d+ new tokens"):
        for event in generate(session, prompt, SamplingConfig(max_new_tokens=40), frozenset()):
            if isinstance(event, Step):
                partial += event.tokens
    assert partial and kv.cache_length(session.runner.cache) == len(session.cached) == len(prompt) + len(partial) - 1
    # Continuing on the same session (as the chat does) gives exactly the greedy continuation.
    rest = [e for e in generate(session, prompt + partial, SamplingConfig(max_new_tokens=20), frozenset())]
    assert isinstance(rest[-1], Done)
    assert partial + list(rest[-1].text_tokens) == hf_greedy(model, prompt, len(partial) + 20)


class GrowthFails(StaticRunner):
    """A fixed-shape runner that runs out of memory whenever its cache would have to grow."""

    def _make_room(self, end, committed):
        if end > self.length:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB")
        return super()._make_room(end, committed)


def test_out_of_memory_while_the_cache_grows_for_a_turn_is_reported_as_such():
    model = tiny_model("llama")
    la = LookaheadConfig(window=3, ngram=3, candidates=3)
    session = Session(model, la, runner=GrowthFails(model, la, context_length=1024, first_length=16))
    prompt = [5, 17, 23, 5, 17, 23, 5, 17, 9, 40, 41, 42]
    with pytest.raises(OutOfMemory, match=r"out of memory on cpu after 0 new tokens"):
        list(generate(session, prompt, SamplingConfig(max_new_tokens=600), frozenset()))
    done = list(generate(session, prompt, SamplingConfig(max_new_tokens=20), frozenset()))[-1]
    assert list(done.text_tokens) == hf_greedy(model, prompt, 20)  # a turn that fits goes on as before


def test_other_runtime_errors_are_not_taken_for_out_of_memory():
    session = Session(FailsAfterForward(tiny_model("llama"), 2, RuntimeError("shape mismatch")), LookaheadConfig())
    with pytest.raises(RuntimeError, match="shape mismatch"):
        list(generate(session, [1, 2, 3, 4], SamplingConfig(max_new_tokens=8), frozenset()))


# The embedded model's fp32 step costs on a quiet 2-core AVX2 EPYC (seconds, 192 and 1536 cached
# tokens): the chats below plan from these, not from a curve this machine measured (maybe while
# busy), so where a Ctrl-C lands in an answer is the same on every machine.
STEP_COST = CostModel({192: {1: 0.085, 2: 0.095, 4: 0.097, 8: 0.120, 16: 0.150, 32: 0.220, 64: 0.360},
                       1536: {1: 0.095, 2: 0.105, 4: 0.110, 8: 0.140, 16: 0.180, 32: 0.280, 64: 0.480}})


def chat_app(loaded, fail_on_call=0, error=torch.OutOfMemoryError("CUDA OOM"), out_file=None):
    """A chat on `loaded` whose model fails after its `fail_on_call`-th forward pass (0: never)."""
    if fail_on_call:
        loaded = replace(loaded, model=FailsAfterForward(loaded.model, fail_on_call, error))
    settings = Settings(window=2, ngram=3, candidates=1, max_new_tokens=24)
    err = io.StringIO()
    out = Console(file=out_file if out_file is not None else io.StringIO())
    return ChatApp(Bot(loaded, settings, step_cost=STEP_COST), None, False, out, Console(file=err, width=300)), err


def test_chat_survives_out_of_memory(embedded_fp32):
    app, err = chat_app(embedded_fp32, fail_on_call=1)  # the prefill itself fails
    app.ask("What is the capital of France?")
    assert app.conversation.messages == []
    assert "error: out of memory on cpu after 0 new tokens" in err.getvalue()
    assert "the question was not answered" in err.getvalue()

    app, err = chat_app(embedded_fp32, fail_on_call=4)  # three steps in
    app.ask("What is the capital of France?")
    question, answer = app.conversation.messages
    assert answer["role"] == "assistant" and answer["interrupted"] and answer["content"]
    assert "the partial answer is kept" in err.getvalue()
    app.ask("And of Germany?")  # the same session goes on
    assert [m["role"] for m in app.conversation.messages] == ["user", "assistant"] * 2
    assert not app.conversation.messages[-1]["interrupted"] and app.conversation.messages[-1]["content"]


@pytest.mark.parametrize("lookahead", [True, False])
@pytest.mark.parametrize("fail_on_call", [1, 6])  # in the prefill, mid-answer
def test_interrupt_leaves_the_session_consistent(lookahead, fail_on_call):
    model = tiny_model("llama")
    prompt = [5, 17, 23, 5, 17, 23, 5, 17, 9, 40, 41, 42]
    la = LookaheadConfig(enabled=lookahead, window=3, ngram=3, candidates=3)
    session = Session(FailsAfterForward(model, fail_on_call, KeyboardInterrupt()), la)
    events = list(generate(session, prompt, SamplingConfig(max_new_tokens=40), frozenset()))
    done = events[-1]
    assert isinstance(done, Done) and done.stats.finish_reason == "interrupted"
    partial = [t for e in events[:-1] for t in e.tokens]
    assert list(done.text_tokens) == partial and (partial == []) == (fail_on_call == 1)
    assert kv.cache_length(session.runner.cache) == len(session.cached)
    rest = [e for e in generate(session, prompt + partial, SamplingConfig(max_new_tokens=20), frozenset())]
    assert partial + list(rest[-1].text_tokens) == hf_greedy(model, prompt, len(partial) + 20)


def test_chat_interrupted_while_printing_keeps_a_consistent_conversation(embedded_fp32):
    app, err = chat_app(embedded_fp32, out_file=InterruptedConsole(at=4))
    app.ask("What is the capital of France?")
    question, answer = app.conversation.messages
    assert answer["interrupted"] and answer["content"] and "the partial answer is kept" in err.getvalue()
    # the answer's statistics all the same: Ctrl-C outside the engine ends it as one inside does
    assert re.search(r"\d+ tokens, .* tokens/step, lookahead W=2 N=3 G=1 \(interrupted\)", err.getvalue())
    app.ask("And of Germany?")  # the session goes on from the interrupted state...
    fresh, _ = chat_app(embedded_fp32)
    fresh.conversation.messages = [dict(m) for m in app.conversation.messages[:3]]
    fresh.answer()  # ...and answers exactly as a new session given the same conversation
    assert app.conversation.messages[-1] == fresh.conversation.messages[-1]
    assert fresh.conversation.messages[-1]["content"] and not fresh.conversation.messages[-1].get("interrupted")


def test_chat_interrupted_before_the_first_token_keeps_the_question(embedded_fp32):
    app, err = chat_app(embedded_fp32, fail_on_call=1, error=KeyboardInterrupt())
    app.ask("What is the capital of France?")
    assert app.conversation.messages[-1] == {"role": "assistant", "content": "", "interrupted": True}
    assert "interrupted before the answer began (/retry answers again)" in err.getvalue()
    app.interrupted_outside_stream()  # e.g. Ctrl-C right after the question was added: nothing to mend
    assert len(app.conversation.messages) == 2
    app.conversation.messages.append({"role": "user", "content": "And of Germany?"})
    app.interrupted_outside_stream()  # ...and here the question gets its (empty) interrupted answer
    assert [m["role"] for m in app.conversation.messages] == ["user", "assistant"] * 2


@pytest.mark.parametrize("reader", ["ladechat", "transformers"])
@pytest.mark.parametrize("error", [torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB"), CPU_OOM])
def test_out_of_memory_while_loading_is_a_load_error(tmp_path, monkeypatch, error, reader):
    """Memory running out while ladechat reads a checkpoint itself (load/checkpoint.py), or while
    transformers' model (read by from_pretrained: own_forward off, as --compile loads) moves to its
    device."""
    from test_cli import tiny_model_folder
    from tiny_models import tiny_tokenizer

    from ladechat.engine.load import checkpoint
    from ladechat.engine.load.loading import LoadError, LoadSpec, load

    folder = tiny_model_folder(tmp_path, tiny_tokenizer())

    def fail(*args, **kwargs):
        raise error

    if reader == "ladechat":
        monkeypatch.setattr(checkpoint, "read_into", fail)
    else:
        monkeypatch.setattr(torch.nn.Module, "to", fail)  # as moving the weights to the device would
    with pytest.raises(LoadError) as info:
        load(LoadSpec(model=str(folder), dtype="float32", device="cpu", own_forward=reader == "ladechat"))
    message = str(info.value)
    assert message.startswith(f"out of memory loading {folder} on cpu (") and "\n" not in message
    assert message.endswith("try --load-in-4bit, --dtype float16, or --device-map auto to spread it over devices")
