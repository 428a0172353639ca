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

FORMAT = "ladechat-conversation"


class ConversationError(UserError, ValueError):
    pass


def oldest_exchange(messages: list[dict]) -> int:
    """How many messages the oldest exchange at the front of `messages` takes: a user message and
    the answer that followed it (the last message is never part of one: it is the question)."""
    return 2 if len(messages) > 2 and messages[1]["role"] == "assistant" else 1


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

    def chat_messages(self) -> list[dict]:
        return self._chat_messages(0)

    def _chat_messages(self, start: int) -> list[dict]:
        """The system prompt and the messages from `start` on, as a chat template takes them."""
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + [{"role": m["role"], "content": m["content"]} for m in self.messages[start:]]

    def encode(self, tokenizer, template: str | None, budget: int) -> tuple[list[int], int]:
        """Prompt ids that fit in `budget` tokens, dropping the oldest turns (never the system
        prompt, never the last user message). Returns (ids, turns dropped). The turns are dropped
        only once the rest fits: when even the last message alone does not, ConversationError
        leaves the conversation as it was."""
        from ladechat import templates  # jinja2: not needed by a client that sends messages (--api)

        start = 0
        while True:
            try:
                ids = templates.encode(tokenizer, self._chat_messages(start), template)
            except templates.TemplateError as exc:
                raise ConversationError(str(exc)) from None
            if not ids:  # a tokenizer that knows none of the text's characters
                raise ConversationError("the model's tokenizer turns this prompt into no tokens")
            if len(ids) <= budget:
                self.forget_oldest(start)
                return ids, start
            if len(self.messages) - start <= 1:
                raise ConversationError(f"the prompt is {len(ids)} tokens, more than the {budget} that fit in the "
                                        "model's context (after room for the answer)")
            start += oldest_exchange(self.messages[start:])

    def drop_oldest_exchange(self) -> int:
        """Drop the oldest exchange (never the system prompt); how many messages that was."""
        count = oldest_exchange(self.messages)
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
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ConversationError(f"no such file: {path}") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ConversationError(f"cannot read {path}: {exc}") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ConversationError(f"{path} is not a ladechat conversation file")
        messages = data.get("messages")
        system = data.get("system")
        ok = isinstance(messages, list) and all(
            isinstance(m, dict) and m.get("role") in ("user", "assistant") and isinstance(m.get("content"), str)
            for m in messages)
        if not ok or not (system is None or isinstance(system, str)):
            raise ConversationError(f"{path} has a malformed message list")
        settings = data.get("settings") if isinstance(data.get("settings"), dict) else {}
        clean = [{"role": m["role"], "content": m["content"], "interrupted": bool(m.get("interrupted", False))}
                 for m in messages]
        return Conversation(system=system, messages=clean), settings
