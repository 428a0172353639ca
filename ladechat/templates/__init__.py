"""Chat templates shipped for models without one, or chosen with --template NAME."""

from __future__ import annotations

import functools
import json
import re
import threading
import weakref
from collections.abc import Callable
from importlib import resources

import jinja2

from ladechat.errors import UserError


class TemplateError(UserError, ValueError):
    pass


RAW = "raw"  # the shipped template that is no chat format: a base model continues the text as given


def names() -> list[str]:
    return sorted(p.name[: -len(".jinja")] for p in resources.files(__name__).iterdir() if p.name.endswith(".jinja"))


def source(name: str) -> str:
    if name not in names():
        raise TemplateError(f"unknown template {name!r} (available: {', '.join(names())})")
    return resources.files(__name__).joinpath(f"{name}.jinja").read_text()


def resolve(tokenizer, template: str | None) -> str | None:
    """The template text to render with: shipped template `template`, None for the model's own, or
    for a model without one (a base model) RAW's: its text continued as given. TemplateError for
    an unknown name. tokenizer=None checks only the name (before loading)."""
    if template is not None:
        return source(template)
    if tokenizer is not None and not has_chat_template(tokenizer):
        return source(RAW)
    return None


def adds_bos(tokenizer) -> bool:
    """Whether the tokenizer starts every text with its beginning-of-text token (Llama, Mistral,
    Gemma do; Qwen, GPT-2 do not), as it behaves: transformers' add_bos_token attribute says False
    for a tokenizer whose post-processor adds it."""
    bos = getattr(tokenizer, "bos_token_id", None)
    try:
        special = tokenizer("x", add_special_tokens=True)["input_ids"]
        plain = tokenizer("x", add_special_tokens=False)["input_ids"]
    except TypeError:  # not a callable tokenizer (a template's test double): its word for it
        return bool(getattr(tokenizer, "add_bos_token", False))
    return bos is not None and special[:1] == [bos] and plain[:1] != [bos]


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


NO_CHAT_TEMPLATE = ("this model has no chat template (a base model): answers continue the text as given "
                    "(--template NAME gives it a chat format)")


def text_of(tokenizer, template: str | None, tools: bool = False) -> str | None:
    """The text of the template a prompt is rendered with; a model's templates by name (some list
    tools in a "tool_use" one) as transformers chooses among them."""
    if template is not None or not has_chat_template(tokenizer):
        return resolve(tokenizer, template)
    own = getattr(tokenizer, "chat_template", None)
    if isinstance(own, dict):
        return (own.get("tool_use") if tools else None) or own.get("default")
    return own or None


def render(tokenizer, messages: list[dict], template: str | None = None, tools: list[dict] | None = None) -> str:
    """The prompt text for `messages`, ending with the assistant's turn about to start; `tools`:
    the functions the model may call, as OpenAI's API lists them (templates/tools.py)."""
    chat_template = resolve(tokenizer, template)
    extra = {"tools": tools} if tools else {}
    if template == RAW or (template is None and chat_template is not None):  # RAW's, asked for or a base model's
        extra["add_bos"] = adds_bos(tokenizer)
    try:
        return tokenizer.apply_chat_template(messages, chat_template=chat_template, add_generation_prompt=True,
                                             tokenize=False, **extra)
    except jinja2.TemplateError as exc:  # e.g. a model's template that raises "System role not supported"
        raise TemplateError(f"the chat template refused this conversation: {exc}") from None


def encode(tokenizer, messages: list[dict], template: str | None = None, tools: list[dict] | None = None) -> list[int]:
    """The prompt's token ids for `messages` and `tools` (as `render` writes them). The template's own markup
    keeps its special (control) tokens; the messages' content never yields one: text in it that
    spells a special token (`<|im_end|>`, `</s>`, ...) is tokenized as the characters it is, so a
    message cannot close its own turn or open another. Every prompt (the chat, `ask`, `serve`) is
    encoded here.

    Content without such text (nearly all) is tokenized exactly as the rendered prompt always was.
    Otherwise each spelled special token is swapped for a marker before rendering, so the only
    special tokens in the rendered text are the template's; the text between two of them that holds
    a marker is then tokenized again, the spelled tokens put back, as plain text."""
    special = _special_tokens(tokenizer)
    spelled = _spelled(tuple(sorted(special.values())))
    if spelled is None or not any(isinstance(m.get("content"), str) and spelled.search(m["content"]) for m in messages):
        return tokenizer(render(tokenizer, messages, template, tools), add_special_tokens=False)["input_ids"]
    texts = [json.dumps(messages, ensure_ascii=False), json.dumps(tools or [], ensure_ascii=False)]  # all rendered
    sentinel = next(chr(c) for c in range(0xE000, 0xF900) if not any(chr(c) in t for t in texts))  # private use
    found: list[str] = []

    def marker(match: re.Match) -> str:
        found.append(match.group())
        return f"{sentinel}{len(found) - 1}{sentinel}"

    marked = [{**m, "content": spelled.sub(marker, m["content"])} if isinstance(m.get("content"), str) else m
              for m in messages]
    rendered = render(tokenizer, marked, template, tools)
    markers = re.compile(f"{sentinel}(\\d+){sentinel}")
    ids: list[int] = []
    section: list[int] = []  # the ids since the last special token
    start = 0  # where the text since the last special token begins

    def close(end: int) -> None:
        text = rendered[start:end]
        if sentinel in text:  # the template's text around content that spelled special tokens
            section[:] = as_text(markers.sub(lambda m: found[int(m.group(1))], text))
        ids.extend(section)
        section.clear()

    as_text = _as_text(tokenizer)
    for token, span in zip(*_markup(tokenizer, rendered, special)):
        if span is None:
            section.append(token)
            continue
        close(span[0])
        ids.append(token)
        start = span[1]
    close(len(rendered))
    return ids


def spelled_special(tokenizer, text: str) -> str | None:
    """The first special (control) token `text` spells, if any: text that reaches a template other
    than as a message's content (a request's tools, a call's arguments) is refused rather than read
    as markup."""
    spelled = _spelled(tuple(sorted(_special_tokens(tokenizer).values())))
    found = spelled.search(text) if spelled is not None else None
    return found.group() if found else None


_AS_TEXT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_AS_TEXT_LOCK = threading.Lock()


def _as_text(tokenizer) -> Callable[[str], list[int]]:
    """A function giving `tokenizer`'s ids for a text in which special tokens' texts are plain
    characters. A fast tokenizer keeps that choice as state on its Rust tokenizer, shared by every
    thread that tokenizes (the server tokenizes a request while the model thread encodes another
    prompt and decodes answers): it is made once on a copy of that tokenizer, never switched on
    the shared one."""
    backend = getattr(tokenizer, "backend_tokenizer", None) if getattr(tokenizer, "is_fast", False) else None
    if backend is None:  # a Python tokenizer takes it as an argument, with no state
        return lambda text: tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    with _AS_TEXT_LOCK:
        copy = _AS_TEXT.get(tokenizer)
        if copy is None:
            from tokenizers import Tokenizer

            copy = Tokenizer.from_str(backend.to_str())
            copy.no_truncation()
            copy.no_padding()
            copy.encode_special_tokens = True
            _AS_TEXT[tokenizer] = copy
    return lambda text: copy.encode(text, add_special_tokens=False).ids


def _special_tokens(tokenizer) -> dict[int, str]:
    """The tokenizer's special (control) tokens: id -> text."""
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return {i: t.content for i, t in added.items() if t.special and t.content}


@functools.lru_cache(maxsize=16)
def _spelled(texts: tuple[str, ...]) -> re.Pattern | None:
    """A pattern matching any of `texts`, longest first (None: there are none)."""
    if not texts:
        return None
    return re.compile("|".join(re.escape(t) for t in sorted(texts, key=len, reverse=True)))


def _markup(tokenizer, text: str, special: dict[int, str]) -> tuple[list[int], list[tuple[int, int] | None]]:
    """`text`'s ids, and for each the (start, end) in `text` of the special token it is where the text
    spells that token there (the template's markup), else None: ordinary tokens, and an unknown
    token (<unk>) that stands for characters outside the vocabulary."""
    unk = getattr(tokenizer, "unk_token_id", None)
    if getattr(tokenizer, "is_fast", False):
        encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = encoded["input_ids"]
        spans = [(b, e) if token in special and token != unk and text[b:e] == special[token] else None
                 for token, (b, e) in zip(ids, encoded["offset_mapping"])]
        return ids, spans
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    spans, at = [], 0  # no offsets: the special tokens' texts, found in order
    for token in ids:
        begin = text.find(special[token], at) if token in special and token != unk else -1
        if begin < 0:
            spans.append(None)
            continue
        at = begin + len(special[token])
        spans.append((begin, at))
    return ids, spans
