"""A soak: 100 answered turns in one chat session on the embedded model, with lookahead toggled,
/set, /undo, /retry, /clear, a Ctrl-C mid-answer and context overflows. What the session keeps
must stay within the bounds its design gives:

- KV cache: the positions of the current prompt and answer, at most the context length (the
  prompt is cut to context - min(max_new_tokens, context / 2) tokens, the answer to what is left);
- the conversation index (context matches): the same tokens as the prompt, at most the context;
- n-gram pool: at most G continuations per key and one key per token id, so <= G x vocab;
- recycled successors: one row of top-8 per token id, so <= vocab rows, and one per pair of
  tokens in a fixed hash table, so <= PAIR_SLOTS pairs;
- resident memory: flat once the caches have reached their working size (no per-turn growth).

Run with `pytest -s tests/test_soak.py` to see the figures (BENCHMARKS.md has a run)."""

import io
import os
from dataclasses import replace

import pytest
from rich.console import Console
from test_properties import send

from ladechat.backends.local import Bot
from ladechat.engine import kv
from ladechat.engine.draft.recycle import PAIR_SLOTS
from ladechat.settings import Settings
from ladechat.ui.chat import ChatApp

CONTEXT = 256  # the embedded model told its context is 256 tokens: the conversation overflows often
TURNS = 100
QUESTIONS = ["What is the capital of France?", "Name a fruit that is yellow.", "Write a haiku about the sea.",
             "What is 12 times 7?", "Give me one tip for sleeping well.", "Translate 'good morning' to Spanish.",
             "What colour is the sky on Mars?", "List three prime numbers.", "Who wrote Hamlet?",
             "Describe a cat in one sentence.", "What does a compiler do?"]
RSS_GROWTH_LIMIT = 200 * 2**20  # bytes after warm-up; one leaked KV cache per turn would be ~1.7 GB


class Output(io.StringIO):
    """The chat's stdout; Ctrl-C arrives while the `at`-th piece of the next answer is printed."""

    def __init__(self) -> None:
        super().__init__()
        self.countdown = 0

    def interrupt_at(self, writes: int) -> None:
        self.countdown = writes

    def write(self, text: str) -> int:
        if self.countdown:
            self.countdown -= 1
            if not self.countdown:
                raise KeyboardInterrupt
        return super().write(text)


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def script():
    """The soak's inputs: (line, whether it is an answered turn)."""
    answered = 0
    i = 0
    while answered < TURNS:
        if i % 10 == 3:
            yield "/lookahead off", False
        if i % 10 == 7:
            yield "/lookahead on", False
        if i % 15 == 5:
            yield ("/set w=3 g=2 n=4" if i % 30 == 5 else "/set w=2 g=1 n=3 temperature=0"), False
        if i == 40:
            yield "/set temperature=0.8 top_p=0.9 seed=1", False
        if i == 55:
            yield "/clear", False
        if i == 66:
            yield "INTERRUPT", False
        if i == 77:
            yield "x " * 300, False  # longer than the whole context: refused, the conversation kept
        if i % 13 == 7:
            yield "/undo", False
        if i % 11 == 9:
            yield "/retry", True
            answered += 1
            i += 1
            continue
        question = QUESTIONS[i % len(QUESTIONS)]
        if i % 9 == 4:
            question = "Summarise this: " + " ".join(QUESTIONS)  # a long one: old turns make room
        yield question, True
        answered += 1
        i += 1


@pytest.mark.slow
def test_soak_100_turns(embedded_fp32):
    loaded = replace(embedded_fp32, context_length=CONTEXT)
    vocab = len(loaded.tokenizer)
    out, err = Output(), io.StringIO()
    app = ChatApp(Bot(loaded, Settings(window=2, ngram=3, candidates=1, max_new_tokens=8)), None, False,
                  Console(file=out), Console(file=err, width=10_000))
    session = app.bot.session
    figures = {"rss": [], "kv": [], "pool": [], "recycled": [], "pairs": [], "context": []}
    answered = 0
    for line, is_answer in script():
        if line == "INTERRUPT":
            out.interrupt_at(3)
            line = "Tell me a long story about a dragon."
            is_answer = True
        before = len(app.conversation.messages)
        send(app, line)
        assert "Traceback" not in err.getvalue()
        if is_answer:
            answered += 1
        figures["rss"].append(resident_bytes())
        figures["kv"].append(kv.cache_length(session.runner.cache))
        figures["pool"].append(len(session.pool))
        figures["recycled"].append(len(session.recycled))
        figures["pairs"].append(session.recycled.pairs())
        figures["context"].append(len(session.context))
        assert kv.cache_length(session.runner.cache) == len(session.cached) <= CONTEXT
        assert len(session.context) <= CONTEXT
        if line.startswith("x "):
            assert len(app.conversation.messages) == before  # the refused question is gone, nothing else

    screen = err.getvalue()
    assert answered >= TURNS
    assert "interrupted: the partial answer is kept" in screen
    assert "dropped the oldest" in screen  # the context overflowed and old turns made room
    assert "error: the prompt is" in screen  # the question longer than the context was refused
    assert screen.count("error:") == 1, [line for line in screen.splitlines() if "error:" in line]

    # the design's bounds
    g = app.bot.settings.candidates
    assert max(figures["kv"]) <= CONTEXT and max(figures["context"]) <= CONTEXT
    assert max(len(session.pool.get(token)) for token in range(vocab)) <= g
    assert max(figures["pool"]) <= 2 * vocab  # G <= 2 throughout the soak
    assert max(figures["recycled"]) <= vocab and max(figures["pairs"]) <= PAIR_SLOTS
    warm = figures["rss"][10]
    assert max(figures["rss"][10:]) - warm < RSS_GROWTH_LIMIT

    # the session is still exact: the last answer is what a fresh session gives the same conversation
    app.command("/set temperature=0")
    app.command("/retry")
    fresh = ChatApp(Bot(loaded, app.bot.settings), None, False, Console(file=io.StringIO()),
                    Console(file=io.StringIO()))
    fresh.conversation.messages = [dict(m) for m in app.conversation.messages[:-1]]
    fresh.answer()
    assert fresh.conversation.messages[-1] == app.conversation.messages[-1]

    mib = 2**20
    print(f"\nsoak: {answered} answered turns, {len(figures['rss'])} inputs, context {CONTEXT}, vocab {vocab}\n"
          f"  RSS MiB: start {figures['rss'][0] / mib:.0f}, after 10 inputs {warm / mib:.0f}, "
          f"peak {max(figures['rss']) / mib:.0f}, end {figures['rss'][-1] / mib:.0f}\n"
          f"  KV cache positions: max {max(figures['kv'])} (bound {CONTEXT}); context index max "
          f"{max(figures['context'])}\n"
          f"  n-gram pool: max {max(figures['pool'])}, end {figures['pool'][-1]} (bound G x vocab = {g} x {vocab})\n"
          f"  recycled successor rows: max {max(figures['recycled'])} (bound vocab = {vocab}); pairs max "
          f"{max(figures['pairs'])} (bound {PAIR_SLOTS})")
