"""The one spec a command builds from its flags (backends/spec.py over engine/load/spec.py): checked
when it is built, without torch, one line for each thing that cannot be; what it hands the three
ways a model answers (a server, a warm local server, this process)."""

import subprocess
import sys

import pytest

from ladechat.backends.spec import LOAD_DEFAULTS, LOAD_FLAGS, Spec, SpecError
from ladechat.engine.config import ConfigError
from ladechat.engine.load.spec import LoadError, LoadSpec
from ladechat.settings import Settings
from ladechat.templates import TemplateError


def params(**changes) -> dict:
    """A command's parameters as typer gives them when no flag is set (every setting, every load option)."""
    unset = dict.fromkeys(Settings.model_fields) | {"store": True, "lookahead": True, "max_new_tokens": 1024,
                                                    "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}
    return unset | {name: LOAD_DEFAULTS[name] for name in LOAD_FLAGS} | {"compile": None, "api": None, "api_key": None} | changes


@pytest.mark.parametrize("options, message", [
    ({"dtype": "float99"}, "unknown --dtype 'float99' (choose auto, float32, bfloat16, float16)"),
    ({"device": "tpu"}, "unknown or unavailable --device 'tpu' (choose auto, cpu, cuda, cuda:N)"),
    ({"attn": "fast"}, "unknown --attn 'fast' (choose sdpa, eager, flash)"),
    ({"weights": "int8"}, "unknown --weights 'int8' (choose auto, dense, packed, int4)"),
    ({"quantize": "q3", "model": "org/m"}, "unknown --quantize 'q3' (choose q4, q8)"),
    ({"context_size": 10}, "--ctx must be at least 64 tokens, got 10"),
    ({"max_memory": "cpu=lots", "device_map": "auto"}, "--max-memory wants DEVICE=SIZE pairs like '0=20GiB,cpu=64GiB', got 'cpu=lots'"),
    ({"max_memory": " , ", "device_map": "auto"}, "--max-memory is empty"),
    ({"max_memory": "cpu=4GiB"}, "--max-memory needs --device-map (e.g. --device-map auto)"),
    ({"model": "org/m", "load_in_4bit": True, "load_in_8bit": True}, "choose one of --load-in-4bit and --load-in-8bit"),
    ({"model": "org/m", "weights": "int4", "device_map": "auto"}, "--weights int4 cannot be combined with --device-map"),
    ({"model": "org/m", "quantize": "q4", "load_in_8bit": True}, "--quantize cannot be combined with --load-in-8bit"),
    ({"model": "org/m", "quantize": "q8", "weights": "dense"}, "--quantize puts the Linear weights on ladechat's kernels: --weights dense"),
    ({"quantize": "q4"}, "(embedded, Q4_1) is a GGUF file, already quantized: --quantize takes a Hugging Face model"),
    ({"model": "/x/m.gguf", "load_in_4bit": True}, "m.gguf is a GGUF file, already quantized: --load-in-4bit and"),
])
def test_a_load_spec_that_cannot_be_is_one_line_when_built(options, message):
    with pytest.raises(LoadError) as caught:
        LoadSpec(**options)
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_the_dtypes_a_spec_takes_are_those_the_loader_maps():
    """spec.py names them without torch, placement.py maps them to torch's: the two lists are one."""
    from ladechat.engine.load.placement import DTYPES
    from ladechat.engine.load.spec import DTYPE_NAMES

    assert set(DTYPE_NAMES) == {"auto", *DTYPES}


def test_compiled_steps_take_the_models_own_modules():
    assert LoadSpec(weights="dense").for_steps(compiled=True) == LoadSpec(weights="dense", pack_weights=False,
                                                                           own_forward=False)
    assert LoadSpec(weights="int4").for_steps(compiled=False) == LoadSpec(weights="int4")
    with pytest.raises(LoadError, match="^--compile compiles the model's own Linear modules: it cannot run --weights int4$"):
        LoadSpec(weights="int4").for_steps(compiled=True)
    with pytest.raises(LoadError, match="it cannot run --quantize$"):
        LoadSpec(model="org/m", quantize="q4").for_steps(compiled=True)


def test_the_spec_holds_what_the_user_and_the_command_chose():
    spec = Spec.of(params(window=3, stop=["END", ""], max_memory="cpu=1GiB", device_map="auto", model="org/m"),
                   given={"window", "stop", "max_memory", "device_map", "model"}, defaults={"temperature": 0.0})
    assert spec.load == LoadSpec(model="org/m", max_memory="cpu=1GiB", device_map="auto")
    assert spec.load.memory_limits == (("cpu", "1GiB"),)
    assert spec.chosen == {"window", "stop", "temperature", "max_new_tokens"}
    assert spec.given["window"] == 3 and spec.given["temperature"] == 0.0 and spec.given["stop"] == ["END"]
    assert "ngram" not in spec.given  # not set: the device's default
    values, chosen = spec.sent()
    assert chosen == {"W", "stop", "temperature", "max_new_tokens"} and values["W"] == 3 and values["stop"] == ["END"]
    # a temperature the user gave is theirs, not the command's default
    assert Spec.of(params(temperature=0.7), {"temperature"}, {"temperature": 0.0}).given["temperature"] == 0.7
    other = spec.with_model("org/other")
    assert other.load == LoadSpec(model="org/other", max_memory="cpu=1GiB", device_map="auto")
    assert (other.settings, other.chosen, other.keep_alive) == (spec.settings, spec.chosen, spec.keep_alive)


def test_a_warm_servers_identity_reads_back_as_the_same_load():
    spec = Spec.of(params(dtype="float32", context_size=512, compile=False), {"dtype", "context_size", "compile"},
                   keep_alive=300.0)
    options = spec.load_options()
    assert set(options) == set(LOAD_DEFAULTS) and options["context_size"] == 512 and options["compile"] is False
    again = Spec.from_load_options(options)
    assert (again.load, again.compile) == (spec.load, spec.compile) and spec.keep_alive == 300.0


@pytest.mark.parametrize("changes, given, message", [
    ({"ngram": 0}, {"ngram"}, "N (n-gram size) must be >= 2, got 0"),
    ({"template": "nope"}, {"template"}, "unknown template 'nope'"),
    ({"api": "http://127.0.0.1:9/v1", "context_size": 512}, {"api", "context_size"},
     "--ctx is about loading a model here; with --api the server has loaded it"),
    ({"api": "http://127.0.0.1:9/v1", "store": False}, {"api", "store"},
     "--store/--no-store: with --api the store of past answers is the server's"),
    ({"quantize": "q4"}, {"quantize"}, "is a GGUF file, already quantized"),
])
def test_a_command_whose_flags_cannot_be_is_one_line_before_anything_loads(changes, given, message):
    with pytest.raises((ConfigError, TemplateError, SpecError, LoadError)) as caught:
        Spec.of(params(**changes), given)
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_with_a_server_the_spec_keeps_no_local_choice():
    spec = Spec.of(params(api="http://127.0.0.1:9/v1", api_key="k"), {"api", "api_key"}, keep_alive=300.0)
    assert (spec.api, spec.api_key, spec.keep_alive) == ("http://127.0.0.1:9/v1", "k", 0.0)
    assert Spec.of(params(api_key="server's own"), {"api_key"}).api_key is None  # serve's --api-key is its own


def test_the_spec_is_built_and_checked_without_torch():
    """The chat shows its prompt at once: building and checking the spec imports no heavy module."""
    script = ("import sys\nfrom ladechat.backends.spec import Spec\nfrom ladechat.engine.load.spec import LoadSpec\n"
              "Spec(LoadSpec(model='org/m', weights='packed', context_size=4096), settings={'window': 3, 'template': 'chatml'})\n"
              "print(sorted(m for m in ('torch', 'transformers', 'numpy') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_flags_a_compiled_step_cannot_run_are_refused_with_the_spec():
    with pytest.raises(LoadError, match="^--compile compiles the model's own Linear modules: it cannot run --weights packed$"):
        Spec.of(params(compile=True, weights="packed"), {"compile", "weights"})
    assert Spec.of(params(weights="packed"), {"weights"}).compile is None  # the device decides, when it loads


def test_a_warm_bot_finds_its_server_again_under_its_own_progress(monkeypatch):
    """The chat's first load shows its progress in the pending prompt; a warm server that expires
    later is found or started again under `again` (the chat's spinner), not under that progress."""
    from ladechat.backends import opener
    from ladechat.keepalive import client

    made = []
    monkeypatch.setattr(client, "ensure", lambda server, keep_alive, root, progress: ("warm", progress))
    monkeypatch.setattr(client, "WarmBot", lambda warm, values, chosen, keep_alive, progress:
                        made.append((warm, progress, keep_alive, chosen)) or "bot")
    first, later = object(), object()
    spec = Spec.of(params(), set(), keep_alive=300.0)
    assert opener.open_bot(spec, first, again=later) == "bot"
    assert made[-1][:3] == (("warm", first), later, 300.0) and {"store", "template", "max_new_tokens"} <= made[-1][3]
    opener.open_bot(spec, first)
    assert made[-1][:2] == (("warm", first), first)
