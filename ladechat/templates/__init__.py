"""Chat templates shipped for models without one, or chosen with --template NAME."""

from __future__ import annotations

from importlib import resources

import jinja2

from ladechat.errors import UserError


class TemplateError(UserError, ValueError):
    pass


def names() -> list[str]:
    return sorted(p.name[: -len(".jinja")] for p in resources.files(__name__).iterdir() if p.name.endswith(".jinja"))


def source(name: str) -> str:
    if name not in names():
        raise TemplateError(f"unknown template {name!r} (available: {', '.join(names())})")
    return resources.files(__name__).joinpath(f"{name}.jinja").read_text()


def resolve(tokenizer, template: str | None) -> str | None:
    """The template text to render with: shipped template `template`, or None for the model's own.
    TemplateError when neither exists. tokenizer=None checks only the name (before loading)."""
    if template is not None:
        return source(template)
    if tokenizer is not None and not getattr(tokenizer, "chat_template", None):
        raise TemplateError("this model has no chat template; pass --template NAME (see: ladechat templates)")
    return None


def render(tokenizer, messages: list[dict], template: str | None = None) -> str:
    """The prompt text for `messages`, ending with the assistant's turn about to start."""
    chat_template = resolve(tokenizer, template)
    try:
        return tokenizer.apply_chat_template(messages, chat_template=chat_template, add_generation_prompt=True,
                                             tokenize=False)
    except jinja2.TemplateError as exc:  # e.g. a model's template that raises "System role not supported"
        raise TemplateError(f"the chat template refused this conversation: {exc}") from None


def encode(tokenizer, messages: list[dict], template: str | None = None) -> list[int]:
    return tokenizer(render(tokenizer, messages, template), add_special_tokens=False)["input_ids"]
