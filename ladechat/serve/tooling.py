"""A request's tools (OpenAI's `tools`, `tool_choice`, `parallel_tool_calls`) -> what the server
does with them: the functions the template lists to the model, the grammar that forces calls where
tool_choice asks for one, and the reader that takes calls back out of the answer. The format of
a call is the chat template's own (templates/tools.py)."""

from __future__ import annotations

import json
from dataclasses import dataclass

from ladechat.engine.grammar import LARK
from ladechat.serve.wire import ApiError, ChatRequest
from ladechat.templates.tools import NAME, CallReader, ToolCall, ToolFormat, calls_grammar, tool_format

ANY_ARGUMENTS = {"type": "object"}  # a function that lists no parameters


@dataclass(frozen=True)
class Tooling:
    fmt: ToolFormat
    tools: list[dict]  # as the template lists them (OpenAI's shape)
    parameters: dict[str, dict]  # function name -> its arguments' JSON schema
    grammar: str | None  # the answer's format (Settings.format) where calls are forced, else None
    many: bool  # several calls in one answer may be taken
    only: str | None = None  # the function tool_choice names

    def reader(self) -> CallReader:
        return CallReader(self.fmt, frozenset(self.parameters))

    def taken(self, calls: list[ToolCall], before: int) -> list[ToolCall]:
        """The calls to send of those just read (`before` already sent): one in all unless many."""
        return calls if self.many else calls[: max(0, 1 - before)]


def tooling_of(req: ChatRequest, template_text: str | None, added: dict[str, int]) -> Tooling | None:
    """The request's tools, checked (ApiError 400 naming the field); None where the answer is text
    (no tools, or tool_choice "none": the functions are not shown to the model). template_text: the
    chat template the prompt is rendered with; added: the tokenizer's added tokens (text -> id)."""
    choice = "auto" if req.tool_choice is None else req.tool_choice
    if not req.tools:
        if choice not in ("none", "auto"):
            raise ApiError(400, "tool_choice: there are no tools to choose from", param="tool_choice")
        return None
    parameters: dict[str, dict] = {}
    for i, tool in enumerate(req.tools):
        name = tool.function.name
        if not NAME.match(name):
            raise ApiError(400, f"tools.{i}.function.name: must be 1-64 letters, digits, _, . or -, got {name!r}",
                           param=f"tools.{i}.function.name")
        if name in parameters:
            raise ApiError(400, f"tools.{i}.function.name: {name!r} is listed twice", param=f"tools.{i}.function.name")
        parameters[name] = tool.function.parameters or ANY_ARGUMENTS
    if choice == "none":
        return None
    fmt = tool_format(template_text)
    if fmt is None:
        raise ApiError(400, "tools: this model's chat template has no tool-call format (a ChatML model can be "
                            "served with --template hermes)", param="tools")
    only = _named(choice, parameters) if isinstance(choice, dict) else None
    many = req.parallel_tool_calls is not False and only is None
    grammar = None
    if choice == "required" or only is not None:
        markers = {text: added[text] for text in (fmt.open, fmt.close) if text in added}
        grammar = LARK + calls_grammar(fmt, parameters, only, many, markers)
    return Tooling(fmt, [tool.model_dump(exclude_none=True) for tool in req.tools], parameters, grammar, many, only)


def _named(choice: dict, parameters: dict[str, dict]) -> str:
    function = choice.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    if choice.get("type") != "function" or not isinstance(name, str):
        raise ApiError(400, 'tool_choice: must be none, auto, required or {"type": "function", "function": '
                            '{"name": ...}}', param="tool_choice")
    if name not in parameters:
        raise ApiError(400, f"tool_choice.function.name: {name!r} is not one of the tools", param="tool_choice.function.name")
    return name


def schema_texts(tooling: Tooling) -> list[tuple[str, str]]:
    """(field, schema as JSON text) for the parameters of each function forced calls may call."""
    names = list(tooling.parameters)
    return [(f"tools.{i}.function.parameters", json.dumps(tooling.parameters[name])) for i, name in enumerate(names)
            if tooling.only is None or name == tooling.only]
