"""Every setting a user can give, in one typed model: the CLI flags, `/set`, `/save` and `/load`
files and the bench all go through `Settings`, so types and ranges are checked in one place and a
bad value is refused with one line (ConfigError). It builds the engine's frozen inputs
(LookaheadConfig, SamplingConfig); the engine itself does not depend on pydantic.

Names are the keys of a saved file (format in conversation.py): W, N, G for the window, n-gram
size and candidates (the paper's letters), the rest spelled out. `/set` takes the same keys in
lower case.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ladechat.engine.config import ConfigError, LookaheadConfig, SamplingConfig

# What a message calls a field (the key users type, with the letter's meaning for W, N, G).
LABELS = {"window": "W (window)", "ngram": "N (n-gram size)", "candidates": "G (candidates)"}
MIN_TEMPERATURE = 0.01  # below this (but above 0, greedy) logits / temperature overflow to inf


class Settings(BaseModel):
    """How to speculate and how to choose tokens, plus the chat template: one answer's settings."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False, validate_by_name=True,
                              validate_by_alias=True, serialize_by_alias=True)

    lookahead: bool = True
    window: int = Field(2, alias="W", ge=1, le=64, description="columns of the Jacobi window")
    ngram: int = Field(3, alias="N", ge=2, le=16, description="n-gram size; the window has N-1 levels")
    candidates: int = Field(1, alias="G", ge=0, le=64, description="pool n-grams kept per key and tried per step")
    context_candidates: int = Field(2, ge=0, le=16, description="continuations matched in the conversation per step")
    context_len: int = Field(12, ge=1, le=64, description="tokens one context continuation proposes")
    recycle: int = Field(16, ge=0, le=256, description="most draft nodes from the model's recycled top-k")
    store: bool = Field(True, description="draft from (and add to) the model's store of past answers")
    max_new_tokens: int = Field(512, ge=1, le=1_000_000)
    temperature: float = Field(0.0, ge=0, le=100, description="0: greedy")
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0, le=1_000_000, description="0: no limit")
    min_p: float = Field(0.0, ge=0, lt=1)
    repetition_penalty: float = Field(1.0, ge=0.01, le=100, description="1: off")
    seed: int | None = Field(None, ge=0, lt=2**63)  # the range torch.Generator.manual_seed takes
    stop: tuple[str, ...] = ()
    template: str | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, value: Any) -> Any:
        # JSON has lists only; anything but a list of strings gets one message for the whole value.
        if isinstance(value, (list, tuple)) and all(isinstance(s, str) for s in value):
            return tuple(value)
        raise ValueError(f"stop must be a list of strings, got {value!r}")

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
        return cls.parse({"lookahead": la.enabled, "window": la.window, "ngram": la.ngram,
                          "candidates": la.candidates, "context_candidates": la.context_candidates,
                          "context_len": la.context_len, "recycle": la.recycle, "store": la.store,
                          **values})

    def as_dict(self) -> dict:
        """JSON-ready, with the keys of a saved file."""
        return self.model_dump(mode="json")

    # -- what the engine takes ------------------------------------------------------------------
    def lookahead_config(self) -> LookaheadConfig:
        return LookaheadConfig(window=self.window, ngram=self.ngram, candidates=self.candidates,
                               context_candidates=self.context_candidates, context_len=self.context_len,
                               recycle=self.recycle, store=self.store, enabled=self.lookahead)

    def sampling_config(self) -> SamplingConfig:
        return SamplingConfig(max_new_tokens=self.max_new_tokens, temperature=self.temperature, top_p=self.top_p,
                              top_k=self.top_k, min_p=self.min_p, repetition_penalty=self.repetition_penalty,
                              seed=self.seed, stop=self.stop)


def keys() -> dict[str, str]:
    """Every key a user may type or a file may hold -> the field it sets (W -> window, w -> window)."""
    found = {}
    for name, info in Settings.model_fields.items():
        for key in {name, info.alias or name}:
            found[key] = name
            found[key.lower()] = name
    return found


def field_name(key: str) -> str:
    """The field `key` names; an unknown key is returned as it is (parse then refuses it)."""
    return keys().get(key, key)


def set_keys() -> list[str]:
    """The keys `/set` takes, in the model's order (stop is a list: /load and --stop set it)."""
    return [(info.alias or name).lower() for name, info in Settings.model_fields.items() if name != "stop"]


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
