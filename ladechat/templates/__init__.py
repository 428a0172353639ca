"""Chat templates shipped for models without one, or chosen with --template NAME."""

from __future__ import annotations

from importlib import resources

import jinja2


class TemplateError(ValueError):
    pass


def names() -> list[str]:
    return sorted(p.name[: -len(".jinja")] for p in resources.files(__name__).iterdir() if p.name.endswith(".jinja"))


def source(name: str) -> str:
    if name not in names():
        raise TemplateError(f"unknown template {name!r} (available: {', '.join(names())})")
    return resources.files(__name__).joinpath(f"{name}.jinja").read_text()


def check(tokenizer, template: str | None) -> None:
    """Raise TemplateError unless a prompt can be rendered: a known --template, or the model's own."""
    if template is not None:
        source(template)
    elif not getattr(tokenizer, "chat_template", None):
        raise TemplateError("this model has no chat template; pass --template NAME (see: ladechat templates)")


def render(tokenizer, messages: list[dict], template: str | None = None) -> str:
    """The prompt text for `messages`, ending with the assistant's turn about to start."""
    check(tokenizer, template)
    try:
        return tokenizer.apply_chat_template(messages, chat_template=source(template) if template else None,
                                             add_generation_prompt=True, tokenize=False)
    except jinja2.TemplateError as exc:  # e.g. a model's template that raises "System role not supported"
        raise TemplateError(f"the chat template refused this conversation: {exc}") from None


def encode(tokenizer, messages: list[dict], template: str | None = None) -> list[int]:
    return tokenizer(render(tokenizer, messages, template), add_special_tokens=False)["input_ids"]
