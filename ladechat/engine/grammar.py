"""An answer held to a grammar: a JSON document, one of a JSON schema, or a Lark grammar (a
server's forced tool calls, templates/tools.py). llguidance's matcher
(docs/design.md says why that library) walks the answer's tokens over the model's own
tokenizer and says which tokens may come next.

Lookahead stays exact under a grammar: verification asks for the model's choice at each row it
visits, and a row's choice is made among the tokens the grammar allows after that row's path
(the answer so far and the draft tokens verified before it), just as plain decoding would make
it one token at a time. Greedy choices first ask whether the row's argmax is allowed (cheap) and
compute the whole mask only when it is not; sampling draws from the masked distribution."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ladechat.engine.config import ConfigError

if TYPE_CHECKING:  # torch is imported where a matcher is made: settings check formats without it
    import torch

JSON = "json"  # any JSON object, as OpenAI's json_object
ANY_OBJECT = {"type": "object"}
LARK = "lark:"  # a format that starts so is llguidance's Lark grammar (the rest of it)


class GrammarError(ConfigError):
    """A format or schema that cannot be held to (one line: what and why): a setting's error."""


def schema_of(answer_format: str) -> dict:
    """The JSON schema an answer format names: "json" (any object) or a schema's JSON text.
    GrammarError for text that is neither."""
    if answer_format == JSON:
        return ANY_OBJECT
    try:
        schema = json.loads(answer_format)
    except json.JSONDecodeError as exc:
        raise GrammarError(f"the answer format is neither 'json' nor a JSON schema ({exc.msg} at column {exc.colno})") from None
    if not isinstance(schema, dict):
        raise GrammarError("a JSON schema is a JSON object, not " + type(schema).__name__)
    return schema


def check_format(answer_format: str) -> None:
    """GrammarError unless the format is one a user gives: "json" or a schema (whether a schema can
    be held to is for GrammarTokenizer.grammar, against a model's tokenizer). A Lark grammar is the
    server's own (forced tool calls), never a setting."""
    if answer_format.startswith(LARK):
        raise GrammarError("a grammar is not an answer format a setting takes (json, or a JSON schema)")
    schema_of(answer_format)


def _library():
    try:
        import llguidance
    except ImportError:  # a dependency of the package; missing only where an install went wrong
        raise GrammarError("answers in a format need the llguidance package: pip install llguidance") from None
    return llguidance


@dataclass
class GrammarTokenizer:
    """The model's tokenizer as the matcher reads it (built once per model: ~1 s at 150k tokens)."""

    lib: object
    tokens: object  # llguidance.LLTokenizer
    vocab_size: int  # the logits' width
    known: int  # the tokenizer's own ids: those past them (a model's padded rows) are never allowed

    @classmethod
    def of(cls, tokenizer, vocab_size: int, eos_ids: frozenset[int]) -> GrammarTokenizer:
        lib = _library()
        import llguidance.hf

        try:
            tokens = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=sorted(eos_ids))
        except (ValueError, TypeError) as exc:
            why = " ".join(str(exc).split())[:300]
            raise GrammarError(f"this model's tokenizer cannot be read for answers in a format: {why}") from None
        return cls(lib, tokens, vocab_size, min(len(tokenizer), vocab_size))

    def grammar(self, answer_format: str) -> str:
        """The grammar of an answer format, checked against this tokenizer: GrammarError (the
        library's own words) for a schema it cannot hold answers to."""
        matcher_class = self.lib.LLMatcher
        what = "the grammar" if answer_format.startswith(LARK) else "the JSON schema"
        try:
            if answer_format.startswith(LARK):
                grammar = matcher_class.grammar_from_lark(answer_format[len(LARK):])
            else:
                grammar = matcher_class.grammar_from_json_schema(schema_of(answer_format),
                                                                 defaults={"whitespace_flexible": False})
        except ValueError as exc:
            raise GrammarError(f"{what} cannot be used: {' '.join(str(exc).split())}") from None
        failed, messages = matcher_class.validate_grammar_with_warnings(grammar, self.tokens)
        if failed:
            raise GrammarError(f"{what} cannot be used: {' '.join(messages[0].split())}")
        return grammar

    def matcher(self, grammar: str, eos_ids: frozenset[int]) -> Matcher:
        return Matcher(self.lib.LLMatcher(self.tokens, grammar, log_level=0), self.vocab_size, eos_ids, self.known)


class Matcher:
    """One answer's walk through a grammar: the tokens consumed so far and what may follow. The
    end of the answer (an EOS id) may follow once the document is whole."""

    def __init__(self, matcher, vocab_size: int, eos_ids: frozenset[int], known: int | None = None) -> None:
        import torch

        self._matcher = matcher
        self.vocab_size = vocab_size
        self.known = vocab_size if known is None else known
        self.eos_ids = eos_ids
        self._bits = torch.empty((vocab_size + 31) // 32, dtype=torch.int32)
        self._shifts = torch.arange(32, dtype=torch.int32)

    def allows(self, token: int) -> bool:
        """Whether `token` may come next, without computing the whole mask (allowed()[token])."""
        if token in self.eos_ids:
            return self._matcher.is_accepting()
        return token < self.known and not self._matcher.is_stopped() and self._matcher.validate_tokens([token]) == 1

    def allowed(self, device=None) -> torch.Tensor:
        """(vocab,) bool on `device` (None: the CPU): the tokens that may come next. GrammarError
        where none may (the matcher's error state)."""
        self._matcher.unsafe_compute_mask_ptr(self._bits.data_ptr(), self._bits.numel() * 4)
        bits = (self._bits.unsqueeze(1) >> self._shifts) & 1
        allowed = bits.reshape(-1)[: self.vocab_size].bool()
        allowed[self.known:] = False
        allowed[sorted(self.eos_ids)] = self._matcher.is_accepting()
        if self._matcher.is_error() or not bool(allowed.any()):
            raise self._failed()
        return allowed if device is None else allowed.to(device, non_blocking=True)

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of `tokens` could follow, one after another, from here."""
        return self._matcher.validate_tokens(tokens)

    def forced(self) -> list[int]:
        """The tokens the grammar forces next, however the model goes on (a schema's keys and
        punctuation), spelled as the tokenizer would: the model may spell them otherwise."""
        return [] if self._matcher.is_stopped() else list(self._matcher.compute_ff_tokens())

    def consume(self, tokens: list[int]) -> None:
        if tokens and not self._matcher.consume_tokens(tokens):
            raise self._failed()

    def rollback(self, count: int) -> None:
        if count and not self._matcher.rollback(count):
            raise self._failed()

    def _failed(self) -> GrammarError:
        """The matcher's error state (a limit of the grammar engine's, say), as one line."""
        why = " ".join((self._matcher.get_error() or "no reason given").split())
        return GrammarError(f"the grammar could not follow the answer: {why[:300]}")

    @property
    def complete(self) -> bool:
        """Whether the answer so far is a whole document (it may end here)."""
        return self._matcher.is_accepting()


def constrained_pick(matcher: Matcher, logits: torch.Tensor, top, picker, history: list[int]
                     ) -> tuple[Callable[[int, list[int]], int], Callable[[], None]]:
    """(verify's pick(row, path) under the grammar, undo(): roll back what it consumed).
    Verification visits rows along one path, so the matcher follows it: before choosing at a row
    it consumes the path's tokens it has not yet seen."""
    consumed: list[int] = []

    def pick(row: int, path: list[int]) -> int:
        if any(token in matcher.eos_ids for token in path[len(consumed):]):
            return int(top[row, 0])  # after the answer's end: the step is cut there, whatever follows
        matcher.consume(path[len(consumed):])
        consumed[:] = path
        if picker.plain_argmax:
            best = int(top[row, 0])
            if matcher.allows(best):
                return best
            return int(logits[row].masked_fill(~matcher.allowed(logits.device), float("-inf")).argmax())
        return picker.pick(logits[row].masked_fill(~matcher.allowed(logits.device), float("-inf")), history + path)

    def undo() -> None:
        matcher.rollback(len(consumed))

    return pick, undo
