"""A conversation (system prompt + turns), how it becomes prompt tokens, and its JSON file format.

File format (`/save`, `/load`), version 1:
    {"format": "ladechat-conversation", "version": 1,
     "model": "<name>", "system": "<text or null>",
     "messages": [{"role": "user"|"assistant", "content": "...", "interrupted": false}, ...],
     "settings": {"lookahead": true, "W": 5, "N": 4, "G": 5, "context_candidates": 2,
                  "context_len": 12, "recycle": 16, "max_new_tokens": 512,
                  "temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0,
                  "repetition_penalty": 1.0, "seed": null, "stop": [], "template": null}}
(the keys and their checks are ladechat.settings.Settings'; a setting missing from a file keeps
its current value when loaded, and keys this version does not know are ignored)
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from ladechat.errors import UserError
from ladechat.paths import Unreadable, read_bounded

FORMAT = "ladechat-conversation"
# Far past any conversation a context holds (a few hundred thousand words): a larger file is not a
# chat, and reading it whole would cost its size several times over in memory.
MAX_FILE_BYTES = 64 * 2**20
# What a chat template reads of a message: its role and text, and a server's tool calls and results.
TEMPLATE_KEYS = ("role", "content", "tool_calls", "tool_call_id", "name")


class ConversationError(UserError, ValueError):
    """A conversation file that cannot be read; `reason` says why without naming the file."""

    def __init__(self, message: str, reason: str | None = None) -> None:
        super().__init__(message)
        self.reason = reason or message


def read_json_file(path: Path) -> object:
    """The JSON a conversation file holds. ConversationError (one line) for anything else: no file,
    a folder, a pipe or device (never opened for reading: it may have no end), a file past
    MAX_FILE_BYTES, text that is not UTF-8 or not JSON, JSON nested past what the parser takes."""
    def refuse(reason: str) -> ConversationError:
        return ConversationError(f"cannot read {path}: {reason}", reason)

    try:
        data = read_bounded(path, MAX_FILE_BYTES)
    except Unreadable as why:
        if why.kind == "missing":
            raise ConversationError(f"no such file: {path}", "no such file") from None
        words = {"folder": "it is a folder", "special": "it is not a regular file",
                 "too large": f"it is larger than {MAX_FILE_BYTES // 2**20} MiB, too large for a conversation"}
        raise refuse(words.get(why.kind, why.detail)) from None
    try:
        return json.loads(data.decode("utf-8"))
    except UnicodeDecodeError:
        raise refuse("it is not UTF-8 text") from None
    except json.JSONDecodeError as exc:
        raise refuse(f"not valid JSON ({exc.msg} at line {exc.lineno})") from None
    except ValueError as exc:  # a number past Python's limits
        raise refuse(f"not JSON Python reads ({' '.join(str(exc).split())[:200]})") from None
    except (RecursionError, MemoryError):
        raise refuse("its JSON is nested too deeply") from None


def oldest_exchange(messages: list[dict], start: int = 0) -> int:
    """How many messages the oldest exchange from `start` takes: a user message and what followed
    it up to the next user message (the answer, and any tool calls and their results); 0 where no
    user message follows (what is left is the turn being answered, never split)."""
    for index in range(start + 1, len(messages)):
        if messages[index]["role"] == "user":
            return index - start
    return 0


def dropped_notice(dropped: int, whose: str) -> str:
    """What the user is told when the oldest `dropped` messages were dropped to fit `whose` context."""
    return (f"the conversation no longer fits the {whose} context: dropped the oldest "
            f"{dropped} message{'s' if dropped > 1 else ''}")


def prompt_budget(context_length: int, max_new_tokens: int) -> int:
    """The most prompt tokens a conversation may take: the rest of the context is room for the
    answer (at most half of it)."""
    return context_length - min(max_new_tokens, context_length // 2)


@dataclass
class Conversation:
    """messages: those the model reads, oldest first; dropped: older ones the context could no
    longer hold (forget_oldest), kept for the transcript that /save and the chat history write."""

    system: str | None = None
    messages: list[dict] = field(default_factory=list)
    dropped: list[dict] = field(default_factory=list)
    tools: list[dict] | None = None  # the functions the model may call (a server's request), OpenAI's shape

    def chat_messages(self) -> list[dict]:
        return self._chat_messages(0)

    def _chat_messages(self, start: int) -> list[dict]:
        """The system prompt and the messages from `start` on, as a chat template takes them."""
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + [{k: m[k] for k in TEMPLATE_KEYS if k in m} for m in self.messages[start:]]

    def encode(self, tokenizer, template: str | None, budget: int) -> tuple[list[int], int]:
        """Prompt ids that fit in `budget` tokens, dropping the oldest turns (never the system
        prompt, never the last user message). Returns (ids, turns dropped). The turns are dropped
        only once the rest fits: when even the last message alone does not, ConversationError
        leaves the conversation as it was.

        Fewest turns dropped, found without encoding the whole transcript: each message alone,
        newest first, until they outgrow the budget, bounds from below where the prompt can begin;
        from there a binary search over the exchanges' starts (a prompt never grows as turns are
        dropped). Time and memory follow the context, not the transcript: a chat of thousands of
        exchanges reopens as fast as a short one."""
        from ladechat import templates  # jinja2: not needed by a client that sends messages (--api)

        encoded: dict[int, list[int]] = {}

        def fits(start: int) -> bool:
            if start in encoded:
                return len(encoded[start]) <= budget
            try:
                ids = templates.encode(tokenizer, self._chat_messages(start), template, self.tools)
            except templates.TemplateError as exc:
                raise ConversationError(str(exc)) from None
            if not ids:  # a tokenizer that knows none of the text's characters
                raise ConversationError("the model's tokenizer turns this prompt into no tokens")
            encoded[start] = ids
            return len(ids) <= budget

        starts = self._exchange_starts()
        floor = self._unreachable_before(tokenizer, budget)
        candidates = [start for start in starts if start >= floor] or starts[-1:]
        if not fits(candidates[-1]):
            raise ConversationError(f"the prompt is {len(encoded[candidates[-1]])} tokens, more than the {budget} "
                                    "that fit in the model's context (after room for the answer)")
        low, high = 0, len(candidates) - 1
        while low < high:
            middle = (low + high) // 2
            if fits(candidates[middle]):
                high = middle
            else:
                low = middle + 1
        at = starts.index(candidates[low])
        while at > 0 and fits(starts[at - 1]):  # the bound was too cautious (a template that trims): step back
            at -= 1
        start = starts[at]
        self.forget_oldest(start)
        return encoded[start], start

    def _exchange_starts(self) -> list[int]:
        """Where the prompt may begin, in order: at 0, then after each oldest exchange in turn,
        until only the last message is left."""
        starts, start = [0], 0
        while step := oldest_exchange(self.messages, start):
            start += step
            starts.append(start)
        return starts

    def _unreachable_before(self, tokenizer, budget: int) -> int:
        """A message index before which no prompt that fits can begin: the messages from it on,
        each encoded alone (its text, less a token or two a template may merge away), already
        hold more than `budget` tokens. 0 when they all fit."""
        total = 0
        for index in range(len(self.messages) - 1, -1, -1):
            text = (self.messages[index]["content"] or "").strip()
            total += max(0, len(tokenizer(text, add_special_tokens=False)["input_ids"]) - 2) if text else 0
            if total > budget:
                return index + 1
        return 0

    def drop_oldest_exchange(self) -> int:
        """Drop the oldest exchange (never the system prompt); how many messages that was."""
        count = oldest_exchange(self.messages) or 1
        self.forget_oldest(count)
        return count

    def forget_oldest(self, count: int) -> None:
        """The oldest `count` messages leave what the model reads; the transcript keeps them."""
        self.dropped.extend(self.messages[:count])
        del self.messages[:count]

    def transcript(self) -> list[dict]:
        """Every message of the conversation, those dropped for the context's sake first."""
        return self.dropped + self.messages

    def to_json(self, model: str, settings: dict) -> str:
        """The file format above, with the whole transcript (loaded again, messages the context
        cannot hold are dropped at the next answer, with a notice)."""
        return json.dumps({"format": FORMAT, "version": 1, "model": model, "system": self.system,
                           "messages": self.transcript(), "settings": settings}, indent=2, ensure_ascii=False)

    @staticmethod
    def from_file(path: Path) -> tuple[Conversation, dict]:
        return Conversation.from_data(read_json_file(path), path)

    @staticmethod
    def from_data(data: object, path: Path) -> tuple[Conversation, dict]:
        """The conversation and settings of a file's JSON (read_json_file); ConversationError
        naming `path` when it is not a conversation file's."""
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ConversationError(f"{path} is not a ladechat conversation file", "not a ladechat conversation file")
        messages = data.get("messages")
        system = data.get("system")
        ok = isinstance(messages, list) and all(
            isinstance(m, dict) and m.get("role") in ("user", "assistant") and isinstance(m.get("content"), str)
            for m in messages)
        if not ok or not (system is None or isinstance(system, str)):
            raise ConversationError(f"{path} has a malformed message list", "a malformed message list")
        settings = data.get("settings") if isinstance(data.get("settings"), dict) else {}
        clean = [{"role": m["role"], "content": m["content"], "interrupted": bool(m.get("interrupted", False))}
                 for m in messages]
        return Conversation(system=system, messages=clean), settings
