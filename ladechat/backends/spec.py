"""A command's choices, checked once: what to load and how (a LoadSpec, and whether the steps are
compiled), the settings chosen, and where the model answers (a server at a URL, a local server that
keeps it loaded, or this process). The command line builds it from its flags (Spec.of) without
importing torch, so every bad flag is one line before anything slow starts; opener.open_bot takes
it and trusts it, and so does everything after it (the warm server's identity, /model's switch)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from ladechat.engine.load.spec import LoadSpec
from ladechat.errors import UserError

# Load options a user names, as flags name them: LoadSpec's fields but those only compiled steps
# change. A warm server's identity holds them and the steps' compile (None: the device decides).
LOAD_FLAGS = tuple(f.name for f in fields(LoadSpec) if f.name not in ("pack_weights", "own_forward"))
LOAD_DEFAULTS = {name: getattr(LoadSpec(), name) for name in LOAD_FLAGS} | {"compile": None}
FLAGS = {"context_size": "--ctx"}  # options whose flag is not their name (typer keeps `ctx` for itself)


def flag_of(option: str) -> str:
    """The command-line flag of an option, e.g. --device-map for device_map."""
    return FLAGS.get(option, "--" + option.replace("_", "-"))


class SpecError(UserError):
    """Flags that cannot go together (one line)."""


@dataclass(frozen=True)
class Spec:
    load: LoadSpec = field(default_factory=LoadSpec)
    compile: bool | None = None  # None: the device decides (opener.compiles)
    # per ladechat.settings field, the value the flags give it (None: not set: the device's defaults,
    # or with a server the server's); and those the user chose, or the command chose for them, which
    # a server is sent
    settings: Mapping[str, Any] = field(default_factory=dict)
    chosen: frozenset[str] = frozenset()
    api: str | None = None  # a server's URL (the model answers there)
    api_key: str | None = None
    keep_alive: float = 0.0  # seconds a local server keeps the model loaded (< 0: until stopped); 0: in this process

    def __post_init__(self) -> None:
        from ladechat.settings import Settings  # pydantic and jinja: not at --help
        from ladechat.templates import resolve

        resolve(None, Settings().updated(self.given).template)  # ConfigError or TemplateError, one line
        if self.compile:  # flags a compiled step cannot run (LoadError); None: the device decides, at load
            self.load.for_steps(compiled=True)

    @classmethod
    def of(cls, params: Mapping[str, Any], given: set[str], defaults: Mapping[str, Any] | None = None,
           keep_alive: float = 0.0, names: tuple[str, ...] | None = None) -> Spec:
        """The spec of a command's parameters (`given`: those the user gave, on the command line or
        through the environment; `defaults`: the command's own choices where the user made none, e.g.
        ask's greedy temperature). Every setting (or every one of `names`, a command that takes only
        those) is a parameter of the command: a renamed parameter fails here (KeyError) rather than
        dropping a setting. Load options the command lacks keep their defaults."""
        from ladechat.settings import Settings

        settings = dict.fromkeys(Settings.model_fields) | {name: params[name] for name in names or Settings.model_fields}
        if settings["stop"]:
            settings["stop"] = [text for text in settings["stop"] if text]
        chosen = {name for name in settings if name in given} | {"max_new_tokens"}
        for name, value in (defaults or {}).items():
            if name not in chosen:
                settings[name] = value
                chosen.add(name)
        api = params.get("api")
        if api is not None:
            _check_remote(given)
        load = LoadSpec(**{name: params[name] for name in LOAD_FLAGS if name in params})
        return cls(load=load, compile=params.get("compile"), settings=settings, chosen=frozenset(chosen), api=api,
                   api_key=params.get("api_key") if api is not None else None,
                   keep_alive=0.0 if api is not None else keep_alive)

    @property
    def given(self) -> dict[str, Any]:
        """The settings the flags set, by field (for settings_for: the rest take the device's defaults)."""
        return {name: value for name, value in self.settings.items() if value is not None}

    def sent(self) -> tuple[dict, set[str]]:
        """(values, chosen) for a server: every setting a request carries (ladechat.settings'
        lookahead, sampling and format groups), by key, and the keys chosen."""
        from ladechat.settings import group, key

        names = group("lookahead") + group("sampling") + group("format")
        values = {key(name): self.settings.get(name) for name in names}
        values["stop"] = list(values["stop"] or [])
        return values, {key(name) for name in names if name in self.chosen}

    def with_model(self, model: str | None) -> Spec:
        """This spec for another model (/model NAME), loaded the same way."""
        return replace(self, load=replace(self.load, model=model))

    def load_options(self) -> dict:
        """What to load and how as flags name them, with compile (LOAD_DEFAULTS' keys): a warm
        server's identity."""
        options = asdict(self.load)
        return {name: options[name] for name in LOAD_FLAGS} | {"compile": self.compile}

    @classmethod
    def from_load_options(cls, options: Mapping[str, Any], **changes) -> Spec:
        """The spec of load_options() (a warm server's), with `changes` (settings, chosen)."""
        load = LoadSpec(**{name: options[name] for name in LOAD_FLAGS if name in options})
        return cls(load=load, compile=options.get("compile"), **changes)


# Options about loading a model here: refused with --api (the server loaded its model; --model
# names the server's).
LOCAL_ONLY = (*(name for name in LOAD_FLAGS if name != "model"), "compile", "template")


def _check_remote(given: set[str]) -> None:
    if "store" in given:
        raise SpecError("--store/--no-store: with --api the store of past answers is the server's (start it with --no-store)")
    for name in LOCAL_ONLY:
        if name in given:
            raise SpecError(f"{flag_of(name)} is about loading a model here; with --api the server has loaded it")
