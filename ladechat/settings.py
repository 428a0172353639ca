"""Every setting a user can give, in one typed model: the CLI flags, `/set`, `/save` and `/load`
files, the server's "ladechat" extension, the `--api` client and the bench all go through
`Settings`, so types, ranges and defaults are stated in one place and a bad value is refused with
one line (ConfigError). It builds the engine's frozen inputs (LookaheadConfig, SamplingConfig),
whose defaults are its own; the engine itself does not depend on pydantic.

Names are the keys of a saved file (format in conversation.py): W, N, G for the window, n-gram
size and candidates (the paper's letters), the rest spelled out. `/set` takes the same keys in
lower case. Each field belongs to one group (GROUPS), from which every list of keys is derived.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ladechat.engine.config import ConfigError, LookaheadConfig, SamplingConfig

# What a message calls a field (the key users type, with the letter's meaning for W, N, G).
LABELS = {"window": "W (window)", "ngram": "N (n-gram size)", "candidates": "G (candidates)"}
MIN_TEMPERATURE = 0.01  # below this (but above 0, greedy) logits / temperature overflow to inf
LOOKAHEAD = LookaheadConfig()  # the defaults: the engine's own
SAMPLING = SamplingConfig()
# The groups of settings: how to speculate (sent to ladechat serve with --api), how to choose
# tokens (sent to any server with --api), and what only a model in this process reads (with --api
# they are the server's: its store of past answers, its template).
# The answer's format (a JSON document, a schema's) is a group of its own: a server takes it as
# OpenAI's response_format.
GROUPS = ("lookahead", "sampling", "local", "format")


def _setting(group: str, default: Any, **field: Any) -> Any:
    return Field(default, json_schema_extra={"group": group}, **field)


class Settings(BaseModel):
    """How to speculate and how to choose tokens, plus the chat template: one answer's settings."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False, validate_by_name=True,
                              validate_by_alias=True, serialize_by_alias=True)

    lookahead: bool = _setting("lookahead", LOOKAHEAD.enabled)
    window: int = _setting("lookahead", LOOKAHEAD.window, alias="W", ge=1, le=64, description="columns of the Jacobi window")
    ngram: int = _setting("lookahead", LOOKAHEAD.ngram, alias="N", ge=2, le=16,
                          description="n-gram size; the window has N-1 levels")
    candidates: int = _setting("lookahead", LOOKAHEAD.candidates, alias="G", ge=0, le=64,
                               description="pool n-grams kept per key and tried per step")
    context_candidates: int = _setting("lookahead", LOOKAHEAD.context_candidates, ge=0, le=16,
                                       description="continuations matched in the conversation per step")
    context_len: int = _setting("lookahead", LOOKAHEAD.context_len, ge=1, le=64,
                                description="tokens one context continuation proposes")
    recycle: int = _setting("lookahead", LOOKAHEAD.recycle, ge=0, le=256,
                            description="most draft nodes from the model's recycled top-k")
    store: bool = _setting("local", LOOKAHEAD.store, description="draft from (and add to) the model's store of past answers")
    max_new_tokens: int = _setting("sampling", SAMPLING.max_new_tokens, ge=1, le=1_000_000)
    temperature: float = _setting("sampling", SAMPLING.temperature, ge=0, le=100, description="0: greedy")
    top_p: float = _setting("sampling", SAMPLING.top_p, gt=0, le=1)
    top_k: int = _setting("sampling", SAMPLING.top_k, ge=0, le=1_000_000, description="0: no limit")
    min_p: float = _setting("sampling", SAMPLING.min_p, ge=0, lt=1)
    repetition_penalty: float = _setting("sampling", SAMPLING.repetition_penalty, ge=0.01, le=100, description="1: off")
    seed: int | None = _setting("sampling", SAMPLING.seed, ge=0, lt=2**63)  # the range torch.Generator.manual_seed takes
    stop: tuple[str, ...] = _setting("sampling", SAMPLING.stop)
    template: str | None = _setting("local", None)
    format: str | None = _setting("format", None, description="json, or a JSON schema: each answer one JSON document")

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, value: Any) -> Any:
        # JSON has lists only; anything but a list of strings gets one message for the whole value.
        if isinstance(value, (list, tuple)) and all(isinstance(s, str) for s in value):
            return tuple(value)
        raise ValueError(f"stop must be a list of strings, got {value!r}")

    @field_validator("format")
    @classmethod
    def _answer_format(cls, value: str | None) -> str | None:
        if value is None:
            return None
        from ladechat.engine.grammar import GrammarError, check_format

        try:
            check_format(value)
        except GrammarError as exc:
            raise ValueError(str(exc)) from None
        return value

    @field_validator("temperature")
    @classmethod
    def _sampling_temperature(cls, value: float) -> float:
        if 0 < value < MIN_TEMPERATURE:
            raise ValueError(f"temperature must be 0 (greedy) or >= {MIN_TEMPERATURE}, got {value}")
        return value

    # -- building and changing ------------------------------------------------------------------
    @classmethod
    def parse(cls, values: dict, strict: bool = True) -> Settings:
        """Settings from a dict of keys (W or window, ...). strict: values must have their own type
        (a file, the CLI); not strict: they may be text to convert (`/set w=3`). ConfigError (one
        line, the first problem) for an unknown key or a bad value."""
        try:
            return cls.model_validate(values, strict=strict)
        except ValidationError as exc:
            raise ConfigError(_one_line(exc.errors()[0])) from None

    def updated(self, values: dict, strict: bool = True) -> Settings:
        """These settings with `values` (keys as for parse) replaced; every value checked again."""
        current = self.model_dump(by_alias=False)
        return Settings.parse({**current, **{field_name(key): value for key, value in values.items()}}, strict)

    @classmethod
    def for_lookahead(cls, la: LookaheadConfig, **values) -> Settings:
        """Settings whose lookahead part is `la` (e.g. the device's defaults) and the rest `values`."""
        return cls.parse({_ENGINE_NAMES.get(f.name, f.name): getattr(la, f.name) for f in dataclasses.fields(la)
                          if _ENGINE_NAMES.get(f.name, f.name) in cls.model_fields} | values)

    def as_dict(self) -> dict:
        """JSON-ready, with the keys of a saved file."""
        return self.model_dump(mode="json")

    # -- what the engine takes ------------------------------------------------------------------
    def lookahead_config(self) -> LookaheadConfig:
        return self._engine(LookaheadConfig)

    def sampling_config(self) -> SamplingConfig:
        return dataclasses.replace(self._engine(SamplingConfig), stop=self.stop_strings())

    def stop_strings(self) -> tuple[str, ...]:
        """The stop strings that end an answer: none in an answer held to a format (the document's
        end ends it, not a stop string inside it)."""
        return () if self.format is not None else self.stop

    def _engine(self, config: type):
        """One of the engine's configs, from the fields it shares with these settings (the rest keep
        the engine's defaults: seed_pool)."""
        return config(**{f.name: getattr(self, _ENGINE_NAMES.get(f.name, f.name)) for f in dataclasses.fields(config)
                         if _ENGINE_NAMES.get(f.name, f.name) in type(self).model_fields})


_ENGINE_NAMES = {"enabled": "lookahead"}  # an engine config's field -> the setting it is


def group(name: str) -> tuple[str, ...]:
    """The fields of one of GROUPS, in the model's order."""
    return tuple(field for field, info in Settings.model_fields.items() if info.json_schema_extra["group"] == name)


def key(field: str) -> str:
    """The key of a field in a saved file, a request's "ladechat" extension and messages (W for window)."""
    return Settings.model_fields[field].alias or field


def keys() -> dict[str, str]:
    """Every key a user may type or a file may hold -> the field it sets (W -> window, w -> window)."""
    found = {}
    for name in Settings.model_fields:
        for spelling in {name, key(name)}:
            found[spelling] = name
            found[spelling.lower()] = name
    return found


def field_name(key: str) -> str:
    """The field `key` names; an unknown key is returned as it is (parse then refuses it)."""
    return keys().get(key, key)


def set_keys() -> list[str]:
    """The keys `/set` takes, in the model's order (stop is a list: /load and --stop set it; a
    format, JSON text or a file: /format)."""
    return [key(name).lower() for name in Settings.model_fields if name not in ("stop", "format")]


def _one_line(error: dict) -> str:
    """pydantic's error (several lines, its own wording) as one line in ours."""
    loc = error.get("loc") or ("",)
    name = str(loc[0])
    label = LABELS.get(name, name)
    value, kind, ctx = error.get("input"), error["type"], error.get("ctx") or {}
    if kind == "extra_forbidden":
        return f"unknown setting {name!r} (settings: {', '.join(set_keys() + ['stop'])})"
    if kind == "value_error":  # our own validators' messages
        return str(ctx.get("error", error["msg"]))
    if kind.startswith("int_"):
        return f"{label} must be a whole number, got {value!r}"
    if kind.startswith(("float_", "finite_")):
        return f"{label} must be a number, got {value!r}"
    if kind.startswith("bool_"):
        return f"{label} must be true or false, got {value!r}"
    bounds = {"greater_than_equal": (">=", "ge"), "greater_than": (">", "gt"), "less_than_equal": ("<=", "le"),
              "less_than": ("<", "lt")}
    if kind in bounds:
        sign, key = bounds[kind]
        bound = ctx[key]
        bound = int(bound) if isinstance(bound, float) and bound.is_integer() else bound  # ">= 0", not ">= 0.0"
        return f"{label} must be {sign} {bound}, got {value}"
    if name == "template":
        return f"template must be a template name or null, got {value!r}"
    return f"{label}: {error['msg']}, got {value!r}"
