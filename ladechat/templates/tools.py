"""Tool calls in a chat template's own format: which format a template writes calls in, the
grammar that holds an answer to calls (tool_choice "required" or a named function), and the calls
read back out of an answer's text as it streams.

Three formats cover the templates people run:
    hermes   <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>, one block per call
             (Qwen2.5 and Qwen3, Hermes, and the shipped `hermes` template for any ChatML model)
    llama3   {"name": ..., "parameters": {...}}, the whole answer (Llama 3.1 and later)
    mistral  [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]
A template is known by the markup it writes a call with; one with none has no tool format."""

from __future__ import annotations

import json
import re
import secrets
import string
from dataclasses import dataclass


@dataclass(frozen=True)
class ToolFormat:
    name: str
    open: str  # the markup before a call (hermes, mistral) or that may come before it (llama3)
    close: str  # the markup after each call (hermes)
    arguments: str  # the key of a call's arguments in its JSON
    listed: bool  # the calls are one JSON array after `open` (mistral)
    whole: bool  # the calls are the whole answer (llama3, mistral): text before them is no call


HERMES = ToolFormat("hermes", "<tool_call>", "</tool_call>", "arguments", listed=False, whole=False)
LLAMA3 = ToolFormat("llama3", "<|python_tag|>", "", "parameters", listed=False, whole=True)
MISTRAL = ToolFormat("mistral", "[TOOL_CALLS]", "", "arguments", listed=True, whole=True)
# A call's JSON spaced as templates write calls in the prompt (jinja's tojson: json.dumps' ", " and
# ": "), so a forced call reads as the calls the model was shown (llguidance's own default is compact).
SPACING = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# Markup of call formats that are not JSON objects (Qwen3-Coder's <function=...>, GLM's <arg_key>,
# Mistral v11's name[ARGS]{...}): refused rather than read as one of the three above.
OTHER_FORMATS = ("<function=", "<arg_key>", "[ARGS]")
NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")  # OpenAI's rule for a function's name (and dots)


def tool_format(template_text: str | None) -> ToolFormat | None:
    """The tool format a chat template's text writes calls in; None where it writes none."""
    if not template_text or "tool" not in template_text:
        return None
    if any(other in template_text for other in OTHER_FORMATS):
        return None
    if "<tool_call>" in template_text:
        return HERMES
    if "[TOOL_CALLS]" in template_text:
        return MISTRAL
    if "<|start_header_id|>" in template_text and ("<|python_tag|>" in template_text or '"parameters"' in template_text):
        return LLAMA3
    return None


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: dict

    def as_openai(self, index: int | None = None) -> dict:
        """The call as OpenAI's API writes it (arguments as JSON text); with `index`, a stream's delta."""
        call = {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": json.dumps(self.arguments, ensure_ascii=False)}}
        return call if index is None else {"index": index, **call}


def new_call_id(fmt: ToolFormat) -> str:
    """An id for a call: Mistral's templates take 9 letters and digits, others OpenAI's call_ form."""
    if fmt is MISTRAL:
        return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))
    return f"call_{secrets.token_hex(12)}"


# -- the grammar of forced calls ----------------------------------------------------------------
def calls_grammar(fmt: ToolFormat, tools: dict[str, dict], only: str | None, many: bool, marker_ids: dict[str, int]
                  ) -> str:
    """The Lark grammar (llguidance's, engine/grammar.py) of an answer that is calls only: to the
    function `only`, else to any of `tools` (name -> parameters' schema); several where `many`.
    Each function's arguments are a `%json` of their own, so a schema's own references ($defs,
    "#") resolve as in the schema alone. marker_ids: the markup that is one token of the model's
    vocabulary (its id), written as that token, since the model writes it so (text elsewhere)."""
    names = [only] if only is not None else list(tools)

    def markup(text: str) -> str:
        return f"<[{marker_ids[text]}]>" if text in marker_ids else json.dumps(text)

    rules = []
    for i, name in enumerate(names):  # {"name": "f", "arguments": {...}}, spaced as SPACING
        head = json.dumps(f'{{"name": {json.dumps(name)}, "{fmt.arguments}": ')
        rules.append(f'call_{i}: {head} args_{i} "}}"\nargs_{i}: %json {json.dumps(with_spacing(tools[name]))}')
    call = " | ".join(f"call_{i}" for i in range(len(names)))
    if fmt.listed:
        start = f'{markup(fmt.open)} "[" call ("," " " call)* "]"' if many else f'{markup(fmt.open)} "[" call "]"'
    elif fmt.close:
        start = 'block ("\\n" block)*' if many else "block"
        rules.append(f'block: {markup(fmt.open)} "\\n" call "\\n" {markup(fmt.close)}')
    else:
        start = "call"
    return "\n".join([f"start: {start}", f"call: {call}", *rules]) + "\n"


def with_spacing(schema: dict) -> dict:
    """The schema with SPACING for llguidance (x-guidance: its options, at a schema's top level)."""
    return {**schema, "x-guidance": {**schema.get("x-guidance", {}), **SPACING}}


# -- calls read back --------------------------------------------------------------------------
def _not_json(constant: str):
    raise ValueError(f"{constant} is not JSON")  # NaN, Infinity: Python's json takes them, clients do not


DECODER = json.JSONDecoder(parse_constant=_not_json)


def _call(fmt: ToolFormat, data, names: frozenset[str]) -> dict | None:
    """A call's JSON object as {"name", "arguments"}, or None where it is not one (no such
    function, arguments that are not an object)."""
    if not isinstance(data, dict) or not isinstance(data.get("name"), str) or data["name"] not in names:
        return None
    arguments = data.get(fmt.arguments, data.get("arguments", data.get("parameters", {})))
    return {"name": data["name"], "arguments": arguments} if isinstance(arguments, dict) else None


class CallReader:
    """An answer's text as it streams -> what to send: content, and each call once it is whole.
    Text that may be the start of a call's markup is held back until it is known not to be one;
    an answer cut inside a call (or a call that does not parse) is content as written."""

    def __init__(self, fmt: ToolFormat, names: frozenset[str]) -> None:
        self.fmt = fmt
        self.names = names
        self.text = ""
        self.sent = 0  # characters of text sent as content, or read as calls
        self.calls: list[ToolCall] = []
        self.content = ""  # all content sent

    def add(self, text: str) -> tuple[str, list[ToolCall]]:
        """(content to send now, calls now whole)."""
        self.text += text
        return self._read(final=False)

    def finish(self) -> tuple[str, list[ToolCall]]:
        return self._read(final=True)

    def _read(self, final: bool) -> tuple[str, list[ToolCall]]:
        content, calls = (self._whole if self.fmt.whole else self._blocks)(final)
        self.content += content
        self.calls += calls
        return content, calls

    def _new(self, call: dict) -> ToolCall:
        return ToolCall(new_call_id(self.fmt), call["name"], call["arguments"])

    def _blocks(self, final: bool) -> tuple[str, list[ToolCall]]:
        """hermes: content, then <tool_call> blocks, each sent once its closing markup has come.
        A block's JSON is read as JSON (its strings may spell the markup); one that is not a call
        is content as written."""
        fmt, content, calls = self.fmt, "", []
        while True:
            start = self.text.find(fmt.open, self.sent)
            if start < 0:
                end = len(self.text) if final else _safe_end(self.text, self.sent, fmt.open)
                if (calls or self.calls) and not self.text[self.sent:end].strip():
                    if final:  # the space between and after calls is the markup's, not content
                        self.sent = end
                    return content, calls
                content += self.text[self.sent:end]
                self.sent = end
                return content, calls
            end, call = self._block(start, final)
            if end is None:  # the block is still coming
                return content, calls
            before = self.text[self.sent:start]
            if call is None:
                content += self.text[self.sent:end]
            else:
                content += before if before.strip() or not (calls or self.calls) else ""
                calls.append(self._new(call))
            self.sent = end

    def _block(self, start: int, final: bool) -> tuple[int | None, dict | None]:
        """(where the block at `start` ends, its call or None); (None, None) while it may yet
        become a call."""
        fmt, text = self.fmt, self.text
        at = start + len(fmt.open)
        at += len(text[at:]) - len(text[at:].lstrip())
        try:
            data, after = DECODER.raw_decode(text, at)
        except (ValueError, RecursionError):
            if not final and (at == len(text) or _may_continue(text[at:])):
                return None, None  # its JSON is still coming
            close = text.find(fmt.close, at)
            if close >= 0:
                return close + len(fmt.close), None
            return (len(text) if final else None), None
        rest = text[after:].lstrip()
        if rest.startswith(fmt.close):
            return len(text) - len(rest) + len(fmt.close), _call(fmt, data, self.names)
        if not final and fmt.close.startswith(rest):
            return None, None
        return after, None

    def _whole(self, final: bool) -> tuple[str, list[ToolCall]]:
        """llama3, mistral: an answer that begins with the markup or a JSON object (array) is held
        whole and read as calls at its end; any other answer is content as it comes."""
        fmt = self.fmt
        head = self.text.lstrip()
        if self.sent == 0 and not self.calls:
            opening = "[" if fmt.listed else "{"
            maybe = fmt.open.startswith(head) or head.startswith((fmt.open, opening))
            if maybe and not final:
                return "", []
            if maybe and final:
                calls = self._parse_whole(head.removeprefix(fmt.open))
                if calls is not None:
                    self.sent = len(self.text)
                    return "", [self._new(call) for call in calls]
        content = self.text[self.sent:]
        self.sent = len(self.text)
        return content, []

    def _parse_whole(self, text: str) -> list[dict] | None:
        try:
            data = DECODER.decode(text)
        except (ValueError, RecursionError):
            return None
        items = data if isinstance(data, list) else [data]
        calls = [_call(self.fmt, item, self.names) for item in items]
        return calls if calls and None not in calls else None


def _may_continue(text: str) -> bool:
    """Whether `text`, cut short, may still grow into one JSON value (it has opened one: its
    first character is a brace), as a streamed call's JSON does until its end has come."""
    return text[:1] == "{"


def _safe_end(text: str, start: int, marker: str) -> int:
    """Where text from `start` may be sent: all but a tail that could begin `marker`."""
    for keep in range(min(len(marker) - 1, len(text) - start), 0, -1):
        if marker.startswith(text[len(text) - keep:]):
            return len(text) - keep
    return len(text)
