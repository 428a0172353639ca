"""The one settings model: types and ranges, one-line messages, the keys /set and files use, and
the engine configs it builds."""

import dataclasses
import json

import pytest

from ladechat.engine.config import ConfigError, LookaheadConfig, SamplingConfig
from ladechat.errors import UserError
from ladechat.settings import Settings, keys, set_keys
from ladechat.ui.commands import CommandError, parse_set


@pytest.mark.parametrize("values,message", [
    ({"N": 1}, "N (n-gram size) must be >= 2, got 1"),
    ({"W": 0}, "W (window) must be >= 1, got 0"),
    ({"G": -1}, "G (candidates) must be >= 0, got -1"),
    ({"W": 65}, "W (window) must be <= 64, got 65"),
    ({"recycle": 257}, "recycle must be <= 256, got 257"),
    ({"context_len": 0}, "context_len must be >= 1, got 0"),
    ({"max_new_tokens": -5}, "max_new_tokens must be >= 1, got -5"),
    ({"temperature": -1.0}, "temperature must be >= 0, got -1.0"),
    ({"temperature": 1e-9}, "temperature must be 0 (greedy) or >= 0.01, got 1e-09"),
    ({"top_p": 0}, "top_p must be > 0, got 0"),
    ({"min_p": 1}, "min_p must be < 1, got 1"),
    ({"seed": -1}, "seed must be >= 0, got -1"),
    ({"seed": 2**64}, f"seed must be < {2**63}, got {2**64}"),
])
def test_ranges(values, message):
    with pytest.raises(ConfigError) as info:
        Settings().updated(values)
    assert str(info.value) == message


@pytest.mark.parametrize("values,message", [
    ({"W": 2.5}, "W (window) must be a whole number, got 2.5"),
    ({"N": True}, "N (n-gram size) must be a whole number, got True"),
    ({"G": "3"}, "G (candidates) must be a whole number, got '3'"),
    ({"lookahead": "yes"}, "lookahead must be true or false, got 'yes'"),
    ({"seed": "x"}, "seed must be a whole number, got 'x'"),
    ({"seed": 1.0}, "seed must be a whole number, got 1.0"),
    ({"max_new_tokens": 10.0}, "max_new_tokens must be a whole number, got 10.0"),
    ({"top_k": False}, "top_k must be a whole number, got False"),
    ({"temperature": "hot"}, "temperature must be a number, got 'hot'"),
    ({"top_p": None}, "top_p must be a number, got None"),
    ({"temperature": float("nan")}, "temperature must be a number, got nan"),
    ({"repetition_penalty": float("inf")}, "repetition_penalty must be a number, got inf"),
    ({"stop": "x"}, "stop must be a list of strings, got 'x'"),
    ({"stop": ["x", 3]}, "stop must be a list of strings, got ['x', 3]"),
    ({"template": 3}, "template must be a template name or null, got 3"),
    ({"colour": "red"}, "unknown setting 'colour'"),
])
def test_types_from_a_file_or_the_cli(values, message):
    """A file can hold any JSON type; a wrong one is refused with one line (a UserError)."""
    with pytest.raises(UserError) as info:
        Settings().updated(values)
    assert str(info.value).startswith(message) and "\n" not in str(info.value)


def test_ints_are_numbers_and_seed_may_be_null():
    s = Settings().updated({"temperature": 1, "top_p": 1, "min_p": 0, "repetition_penalty": 2, "seed": None,
                            "stop": ["a"]})
    assert s.temperature == 1.0 and isinstance(s.temperature, float) and s.seed is None and s.stop == ("a",)


def test_a_saved_file_round_trips():
    s = Settings().updated({"W": 7, "N": 5, "G": 4, "context_len": 9, "recycle": 0, "temperature": 0.7,
                            "seed": 3, "stop": ["END"], "template": "chatml", "lookahead": False})
    saved = json.loads(json.dumps(s.as_dict()))
    assert saved["W"] == 7 and saved["stop"] == ["END"] and saved["lookahead"] is False
    assert Settings.parse(saved) == s


def test_set_takes_text_and_the_same_checks():
    values = parse_set("w=3 N=4 context_candidates=0 recycle=8 temperature=0.5 seed=none lookahead=off")
    s = Settings().updated(values, strict=False)
    assert (s.window, s.ngram, s.context_candidates, s.recycle, s.temperature, s.seed, s.lookahead) == \
        (3, 4, 0, 8, 0.5, None, False)
    for text, message in [("w=2.5", "W (window) must be a whole number, got '2.5'"),
                          ("n=1", "N (n-gram size) must be >= 2, got 1"),
                          ("temperature=inf", "temperature must be a number, got 'inf'")]:
        with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
            Settings().updated(parse_set(text), strict=False)
    for text in ["", "colour=red", "w", "stop=x"]:
        with pytest.raises(CommandError):
            parse_set(text)


def test_every_user_facing_engine_field_has_a_key():
    """/set, files and the bench reach every LookaheadConfig and SamplingConfig field users may set."""
    internal = {"seed_pool", "enabled"}  # enabled is the `lookahead` key
    fields = {f.name for f in dataclasses.fields(LookaheadConfig)} | {f.name for f in dataclasses.fields(SamplingConfig)}
    assert fields - internal <= set(keys().values())
    assert {"w", "n", "g", "context_candidates", "context_len", "recycle", "seed", "template"} <= set(set_keys())


def test_builds_the_engine_configs():
    s = Settings().updated({"W": 4, "N": 5, "G": 2, "context_candidates": 1, "context_len": 6, "recycle": 3,
                            "lookahead": False, "max_new_tokens": 9, "temperature": 0.5, "top_p": 0.9, "top_k": 7,
                            "min_p": 0.1, "repetition_penalty": 1.2, "seed": 11, "stop": ["x"]})
    assert s.lookahead_config() == LookaheadConfig(window=4, ngram=5, candidates=2, context_candidates=1,
                                                   context_len=6, recycle=3, enabled=False)
    assert s.sampling_config() == SamplingConfig(max_new_tokens=9, temperature=0.5, top_p=0.9, top_k=7, min_p=0.1,
                                                 repetition_penalty=1.2, seed=11, stop=("x",))
    la = LookaheadConfig(window=15, ngram=5, candidates=15, context_candidates=4, context_len=10)
    assert Settings.for_lookahead(la, max_new_tokens=3).lookahead_config() == la


def test_settings_are_frozen():
    with pytest.raises(Exception, match="frozen"):
        Settings().window = 3
