"""The real `ladechat` command: piped ask, --json, and one-line errors for bad input."""

import importlib.util
import json
import os
import platform
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from conftest import PATIENCE_S, ladechat_bin

from ladechat.engine.load import packing

# whether ladechat packs fp32 CPU weights here (x86-64 with oneDNN), so hf-packed joins greedy benches
PACKED = packing.supported(torch.device("cpu"), torch.float32)
HF_REFERENCES = ["hf", "hf-packed"] if PACKED else ["hf"]


def ladechat(*args, stdin=None, env_extra=None, timeout=PATIENCE_S):
    env = {**os.environ, "NO_COLOR": "", **(env_extra or {})}
    return subprocess.run([ladechat_bin(), *args], input=stdin, capture_output=True, timeout=timeout, env=env)


def test_ask_piped_is_plain_text():
    r = ladechat("ask", "--max-new-tokens", "24", stdin=b"What is the capital of France?")
    assert r.returncode == 0, r.stderr
    out = r.stdout.decode()
    assert out.strip() and out.endswith("\n") and out.count("\n") >= 1  # the answer, whatever it says
    assert "\x1b[" not in out  # no ANSI codes when stdout is a pipe
    assert "tokens/step" in r.stderr.decode() and "tokens/step" not in out  # the footer is a diagnostic: stderr


def test_ask_json_fields(embedded_fp32):
    r = ladechat("ask", "--json", "--max-new-tokens", "32", "Name three colors.")
    assert r.returncode == 0, r.stderr
    record = json.loads(r.stdout)
    for key in ("new_tokens", "steps", "compression", "tokens_per_s", "ttft_s", "lookahead", "W", "N", "G"):
        assert key in record["stats"]
    assert record["stats"]["new_tokens"] == len(record["token_ids"])
    tok = embedded_fp32.tokenizer
    assert tok.decode(record["token_ids"], skip_special_tokens=True) == record["text"]


@pytest.mark.parametrize("args,message", [
    (["ask", "-N", "0", "hi"], "N (n-gram size) must be >= 2, got 0"),
    (["ask", "-W", "-1", "hi"], "W (window) must be >= 1, got -1"),
    (["ask", "--max-new-tokens", "-5", "hi"], "max_new_tokens must be >= 1, got -5"),
    (["ask", "--temperature", "-1", "hi"], "temperature must be >= 0, got -1.0"),
    (["ask", "--dtype", "float99", "hi"], "unknown --dtype 'float99'"),
    # cuda:99 exists on no machine: without CUDA the message says so, with it that there is no such GPU
    (["ask", "--device", "cuda:99", "hi"],
     "--device cuda:99: no such GPU" if torch.cuda.is_available() else "CUDA is not available here"),
    (["ask", "--device", "cuda:x", "hi"],
     "--device cuda:x: no such GPU" if torch.cuda.is_available() else "CUDA is not available here"),
    (["ask", "--template", "nope", "hi"], "unknown template 'nope'"),
    (["ask", "--model", "/no/such/folder", "hi"], "model folder not found: /no/such/folder"),
    (["ask", "--model", "nobody/no-such-model-xyz", "hi"], "hub cannot be reached"),
    (["ask", "--max-memory", "cpu=lots", "--device-map", "auto", "hi"], "--max-memory wants DEVICE=SIZE pairs"),
    (["ask", "--max-memory", "cpu=4GiB", "hi"], "--max-memory needs --device-map"),
    (["ask", "-f", "/no/such/notes.txt", "hi"], "no such file: /no/such/notes.txt"),
    (["ask", "--ctx", "10", "hi"], "--ctx must be at least 64 tokens, got 10"),
    (["ask", "--ctx", "100000", "hi"], "--ctx 100000 is more than the model's context of 8192 tokens"),
    (["ask", "--api", "http://127.0.0.1:9/v1", "--ctx", "512", "hi"],
     "--ctx is about loading a model here; with --api the server has loaded it"),
    (["ask", "--compile", "-W", "64", "-N", "16", "-G", "64", "hi"], "more than the 512 a fixed-shape step allows"),
    (["ask", "--quantize", "q3", "hi"], "unknown --quantize 'q3' (choose q4, q8)"),
    (["ask", "--quantize", "q4", "hi"], "is a GGUF file, already quantized: --quantize takes a Hugging Face model"),
    (["ask", "--api", "http://127.0.0.1:9/v1", "--quantize", "q8", "hi"],
     "--quantize is about loading a model here; with --api the server has loaded it"),
    (["bench", "step-cost", "--sizes", "1,3"], "step sizes must be 1 or multiples of 4"),
    (["bench", "step-cost", "--shape", "llama-99b"], "unknown --shape 'llama-99b'"),
    # the forms from before `ladechat bench` had subcommands name the subcommand they became
    (["bench", "--step-cost", "--shape", "tiny"],
     "'ladechat bench --step-cost' is now a subcommand: ladechat bench step-cost --shape tiny"),
    (["bench", "--api", "http://127.0.0.1:9/v1", "-d", "mtbench"],
     "'ladechat bench --api' is now a subcommand: ladechat bench serving --api http://127.0.0.1:9/v1 -d mtbench"),
])
def test_bad_input_one_line_error(args, message):
    r = ladechat(*args, env_extra={"HF_HUB_OFFLINE": "1"})
    err = r.stderr.decode().strip()
    assert r.returncode == 1
    assert message in err
    assert err.startswith("ladechat: error:") and "\n" not in err and "Traceback" not in err


def test_folder_that_is_not_a_model(tmp_path):
    r = ladechat("ask", "--model", str(tmp_path), "hi")
    assert r.returncode == 1
    assert "is not a model folder (no config.json in it)" in r.stderr.decode()


def test_empty_and_binary_stdin():
    r = ladechat("ask", stdin=b"   \n")
    assert r.returncode == 1 and "empty prompt" in r.stderr.decode()
    r = ladechat("ask", stdin=b"\xff\xfe\x00bad")
    assert r.returncode == 1 and "not valid UTF-8" in r.stderr.decode()


def test_help_lists_every_option():
    r = ladechat("ask", "--help")
    text = r.stdout.decode()
    for opt in ("--model", "--lookahead", "--window", "--ngram", "--candidates", "--max-new-tokens",
                "--temperature", "--top-p", "--top-k", "--seed", "--dtype", "--device", "--load-in-4bit",
                "--load-in-8bit", "--device-map", "--max-memory", "--attn", "--template", "--system", "--stop",
                "--compile", "--markdown", "--debug", "--json", "--quantize"):
        assert opt in text, opt
    r = ladechat("templates")
    assert r.stdout.decode().split() == ["alpaca", "chatml", "hermes", "llama-2", "raw", "vicuna", "zephyr"]


def tiny_model_folder(path, tokenizer, chat_template="", **shape):
    """A tiny random Llama saved with the embedded tokenizer; chat_template None removes it, a
    string replaces it ("" keeps the tokenizer's own); `shape` overrides config fields."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{**dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512), **shape})
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    if chat_template != "":
        settings_file = path / "tokenizer_config.json"
        settings = json.loads(settings_file.read_text())
        settings.pop("chat_template", None)
        (path / "chat_template.jinja").unlink(missing_ok=True)
        if chat_template is not None:
            settings["chat_template"] = chat_template
        settings_file.write_text(json.dumps(settings))
    return path


def test_local_folder_model(tmp_path, embedded_fp32):
    """A model folder on disk (a tiny random Llama with the embedded tokenizer) loads and answers."""
    tiny_model_folder(tmp_path, embedded_fp32.tokenizer)
    r = ladechat("ask", "--model", str(tmp_path), "--dtype", "float32", "--max-new-tokens", "6", "--json", "hi")
    assert r.returncode == 0, r.stderr
    record = json.loads(r.stdout)
    assert record["model"] == str(tmp_path) and 1 <= record["stats"]["new_tokens"] <= 6


def test_model_without_a_chat_template_takes_a_shipped_one(tmp_path, embedded_fp32):
    """(Without one it continues the text: tests/test_base_models.py.)"""
    folder = tiny_model_folder(tmp_path, embedded_fp32.tokenizer, chat_template=None)
    r = ladechat("ask", "--model", str(folder), "--template", "chatml", "--max-new-tokens", "4", "--json", "hi")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["stats"]["new_tokens"] >= 1


def test_chat_template_that_refuses_the_conversation(tmp_path, embedded_fp32):
    """Some models' templates raise (e.g. Gemma's "System role not supported"): one line, no traceback."""
    template = ("{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
                "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:")
    folder = tiny_model_folder(tmp_path, embedded_fp32.tokenizer, chat_template=template)
    r = ladechat("ask", "--model", str(folder), "--system", "Be brief.", "hi")
    err = r.stderr.decode()
    assert r.returncode == 1 and "Traceback" not in err
    assert err.strip() == "ladechat: error: the chat template refused this conversation: System role not supported"
    r = ladechat("ask", "--model", str(folder), "--max-new-tokens", "4", "hi")  # without a system prompt it works
    assert r.returncode == 0, r.stderr
    # The chat says so, drops the question and goes on.
    r = ladechat("--model", str(folder), "--system", "Be brief.", stdin=b"hi\n/save " + str(tmp_path / "c.json").encode())
    err = r.stderr.decode()
    assert r.returncode == 0 and "Traceback" not in err
    assert "error: the chat template refused this conversation: System role not supported" in err
    assert json.loads((tmp_path / "c.json").read_text())["messages"] == []


def test_gguf_file_model():
    from ladechat.engine.load.gguf.files import embedded_gguf

    path = embedded_gguf()
    r = ladechat("ask", "--model", str(path), "--max-new-tokens", "8", "--json", "Say hello.")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["model"] == path.name


def test_stop_string_ends_the_answer():
    """A stop string taken from the answer itself ends it there. Plain fp32 decoding: both runs take
    the same steps, so they answer alike on any machine."""
    args = ["ask", "--json", "--dtype", "float32", "--no-lookahead", "--max-new-tokens", "40",
            "Count from 1 to 10, separated by commas."]
    whole = json.loads(ladechat(*args).stdout)["text"]
    stop = whole[len(whole) // 2:][:3]  # three characters from the middle
    assert len(stop) == 3, whole
    r = ladechat(*args, "--stop", stop)
    assert r.returncode == 0, r.stderr
    record = json.loads(r.stdout)
    assert record["stats"]["finish_reason"] == "stop"
    assert record["text"] == whole[:whole.index(stop) + len(stop)]  # up to and with the stop string, as asked


def test_ctrl_c_ends_ask_with_the_partial_answer_and_its_statistics(tmp_path):
    """Ctrl-C mid-answer: what was answered stays on stdout, the footer says "(interrupted)" wherever
    the signal landed (in a step or while a word was printed), and the exit status is 130. The
    model has no end-of-text token and the answer may run for minutes: it cannot end first."""
    from tiny_models import endless_model_folder

    folder = endless_model_folder(tmp_path / "endless")
    proc = subprocess.Popen([ladechat_bin(), "ask", "--keep-alive", "0", "--model", str(folder), "--dtype", "float32",
                             "--max-new-tokens", "200000", "Tell me a story."],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "NO_COLOR": ""})
    first = proc.stdout.read(20)  # it is answering
    proc.send_signal(signal.SIGINT)
    assert proc.wait(60) == 130
    out, err = first + proc.stdout.read(), proc.stderr.read().decode()
    assert re.search(r"\d+ tokens, .* tokens/step, lookahead W=\d+ N=\d+ G=\d+ \(interrupted\), context [\d,]+/[\d,]+\n",
                     err), err
    assert "Traceback" not in err and len(out.decode().rstrip("\n")) >= 20  # the answer so far stays


def _blocked_reading_stdin(pid: int, timeout: float = 60.0) -> None:
    """Wait until process `pid` sits in read(0, ...): a known point to send a signal at."""
    read = {"x86_64": "0", "aarch64": "63"}[platform.machine()]  # the read system call's number
    deadline = time.monotonic() + timeout
    while True:
        fields = Path(f"/proc/{pid}/syscall").read_text().split()
        if fields[:2] == [read, "0x0"]:
            return
        assert time.monotonic() < deadline, f"never blocked reading stdin: {fields[:2]}"
        time.sleep(0.02)


def test_ctrl_c_while_ask_waits_for_its_prompt_exits_130():
    """Ctrl-C before any model is loaded (ask waiting for its prompt on stdin): 130, no traceback."""
    proc = subprocess.Popen([ladechat_bin(), "ask", "--keep-alive", "0"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "NO_COLOR": ""})
    try:
        _blocked_reading_stdin(proc.pid)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 130
    finally:
        proc.kill()
        proc.stdin.close()
    assert "Traceback" not in proc.stderr.read().decode() and proc.stdout.read() == b""


def test_chat_rejects_bad_flags_before_loading():
    r = ladechat("-N", "0")
    assert r.returncode == 1
    assert r.stderr.decode().strip() == "ladechat: error: N (n-gram size) must be >= 2, got 0"


def test_prompt_longer_than_the_context():
    r = ladechat("ask", "--max-new-tokens", "8", stdin=("lorem ipsum " * 6000).encode())
    err = r.stderr.decode().strip()
    assert r.returncode == 1 and "Traceback" not in err
    assert err.startswith("ladechat: error: the prompt is") and "that fit in the model's context" in err


def test_ctx_caps_the_conversation_and_the_footer_says_how_full_it_is():
    r = ladechat("ask", "--ctx", "256", "--max-new-tokens", "8", "What is the capital of France?")
    assert r.returncode == 0, r.stderr
    used = re.search(r"tokens/step, lookahead .*, context (\d+)/256$", r.stderr.decode().strip())
    assert used and 8 < int(used.group(1)) <= 256
    long = ladechat("ask", "--ctx", "128", "--max-new-tokens", "8", stdin=("lorem ipsum " * 100).encode())
    err = long.stderr.decode().strip()
    assert long.returncode == 1 and "Traceback" not in err
    assert "more than the 120 that fit in the model's context" in err  # 128, less room for 8 new tokens


def test_flash_attention_falls_back_to_sdpa_with_a_notice(tmp_path):
    """The notice depends on whether flash-attn is installed here; the answer comes either way."""
    from tiny_models import tiny_tokenizer

    folder = tiny_model_folder(tmp_path, tiny_tokenizer())
    r = ladechat("ask", "--model", str(folder), "--attn", "flash", "--max-new-tokens", "4", "--dtype", "float32", "Hi")
    assert r.returncode == 0 and r.stdout.decode().strip()
    if importlib.util.find_spec("flash_attn") is None:
        notice = "notice: flash-attn is not installed (pip install 'ladechat[flash]'); using sdpa"
    else:
        notice = "notice: flash-attn cannot take the lookahead step's tree mask; using sdpa for every step"
    assert notice in r.stderr.decode()


def test_step_cost_bench_on_a_random_model():
    r = ladechat("bench", "step-cost", "--shape", "tiny", "--sizes", "1,8,16", "--reps", "2", "--context", "64",
                 "--dtype", "float32", "--json")
    assert r.returncode == 0, r.stderr.decode()
    result = json.loads(r.stdout)
    assert result["model"] == "random tiny" and result["context"] == 64 and result["hf_generate_per_token_s"] > 0
    assert result["packed_weights"] is PACKED  # as the chat would load it here
    assert set(result["curves"]) == {"dynamic", "llama", "static"}  # a Llama shape on a CPU: its Llama steps too
    for curve in result["curves"].values():
        assert set(curve) == {"1", "8", "16"} and all(t > 0 for t in curve.values())


def test_a_model_path_that_is_not_a_model_file_says_what_it_is(tmp_path):
    (tmp_path / "model.gguf").mkdir()
    os.mkfifo(tmp_path / "pipe.gguf")
    for name, why in (("model.gguf", "is a folder, not a GGUF file"),
                      ("pipe.gguf", "is not a regular file (a GGUF file is read from disk)"),
                      ("missing.gguf", None)):
        r = ladechat("ask", "--model", str(tmp_path / name), "hi")
        want = f"GGUF file not found: {tmp_path / name}" if why is None else f"{tmp_path / name} {why}"
        assert r.returncode == 1 and r.stderr.decode() == f"ladechat: error: {want}\n"


def test_weights_that_are_not_numbers_are_named_as_such_not_the_mask(tmp_path):
    from safetensors.torch import load_file, save_file
    from tiny_models import tiny_tokenizer

    folder = tiny_model_folder(tmp_path / "model", tiny_tokenizer())
    weights = load_file(folder / "model.safetensors")
    save_file({name: torch.full_like(t, float("nan")) for name, t in weights.items()}, folder / "model.safetensors",
              metadata={"format": "pt"})
    for flags in ((), ("--no-lookahead",)):
        r = ladechat("ask", "--model", str(folder), "--dtype", "float32", *flags, "hi")
        err = r.stderr.decode()
        assert r.returncode == 1 and err.count("\n") == 1, err
        assert err == (f"ladechat: error: {folder}: its logits are NaN or infinite on a plain forward pass: the "
                       "weights are not numbers (a corrupt or badly converted file)\n")


def test_step_cost_kept_for_a_model_is_shown_and_reset(tmp_path):
    """`bench step-cost --show` prints what the chat plans with (nothing before its first use),
    --reset forgets it so the next use measures afresh."""
    from tiny_models import tiny_tokenizer

    folder = str(tiny_model_folder(tmp_path / "model", tiny_tokenizer()))
    model = ("--model", folder, "--dtype", "float32")
    r = ladechat("bench", "step-cost", "--show", *model)
    assert r.returncode == 0 and r.stdout == b""
    assert "no step costs kept for" in r.stderr.decode() and "its first chat measures them" in r.stderr.decode()
    assert ladechat("ask", *model, "--max-new-tokens", "8", "Hello").returncode == 0  # measures the curves
    r = ladechat("bench", "step-cost", "--show", "--json", *model)
    assert r.returncode == 0, r.stderr.decode()
    shown = json.loads(r.stdout)
    assert shown["measured"] and shown["sizes"][0]["size"] == 1
    for row in shown["sizes"]:
        assert 0 < row["could_s"] <= row["kept_s"] <= row["measured_s"] and isinstance(row["in_doubt"], bool)
    table = ladechat("bench", "step-cost", "--show", *model).stdout.decode()
    assert "step costs kept" in table and "planned ms" in table
    r = ladechat("bench", "step-cost", "--reset", *model)
    assert r.returncode == 0 and r.stderr.decode() == f"forgot the step costs kept for {folder}: its next chat measures them\n"
    again = ladechat("bench", "step-cost", "--show", *model)
    assert again.returncode == 0 and again.stderr.decode() == (
        f"no step costs kept for {folder} on this machine yet: its first chat measures them\n")
    r = ladechat("bench", "step-cost", "--show", "--reset", *model)
    assert r.returncode == 1 and r.stderr.decode() == "ladechat: error: give --show or --reset, not both\n"


def test_ask_compiled_gives_the_same_tokens(tmp_path, embedded_fp32):
    """--compile (static cache, fixed-shape steps, torch.compile, the Linear weights as loaded)
    answers token for token like the default runner (on packed weights). A small random Llama with
    the embedded tokenizer keeps compiling short on a CPU."""
    tiny_model_folder(tmp_path, embedded_fp32.tokenizer, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, initializer_range=0.2)
    args = ["--model", str(tmp_path), "--dtype", "float32", "--max-new-tokens", "40", "-W", "3", "-N", "3", "-G", "3",
            "--json", "Name three rivers in Europe, then three more."]
    plain = ladechat("ask", *args)
    compiled = ladechat("ask", "--compile", *args, timeout=600)
    assert plain.returncode == 0 and compiled.returncode == 0, compiled.stderr.decode()
    ours, ref = json.loads(compiled.stdout), json.loads(plain.stdout)
    assert ours["token_ids"] == ref["token_ids"] and ours["stats"]["new_tokens"] >= 10



def test_missing_bitsandbytes_is_one_line(tmp_path):
    # a bitsandbytes that fails to import, as on a machine without it (it is a dev dependency here)
    (tmp_path / "bitsandbytes").mkdir()
    (tmp_path / "bitsandbytes" / "__init__.py").write_text("raise ImportError(\"No module named 'bitsandbytes'\")\n")
    from tiny_models import tiny_tokenizer

    folder = tiny_model_folder(tmp_path / "model", tiny_tokenizer())  # a Hugging Face model: bitsandbytes' kind
    for flag in ("--load-in-4bit", "--load-in-8bit"):
        path = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))  # first, not alone
        r = ladechat("ask", "--model", str(folder), flag, "hi", env_extra={"PYTHONPATH": path})
        err = r.stderr.decode().strip()
        assert r.returncode == 1 and "\n" not in err and "Traceback" not in err
        assert f"ladechat: error: {flag} needs bitsandbytes" in err and "pip install 'ladechat[quant]'" in err


def broken_model(kind, path):
    """A model the user points --model at that cannot load, of each kind we have met."""
    from tiny_models import tiny_tokenizer

    if kind == "config field of the wrong type":
        tiny_model_folder(path, tiny_tokenizer())
        config = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**config, "hidden_size": "x"}))
    elif kind == "not a gguf":
        path = path / "model.gguf"
        path.write_bytes(b"PK\x03\x04 this is a zip file, not a GGUF one" * 4)
    elif kind == "truncated gguf":
        path = path / "model.gguf"
        path.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + (5).to_bytes(7, "little"))  # 15 bytes
    elif kind == "gguf cut short in its weights":
        from test_int4 import write_tiny_gguf

        whole = write_tiny_gguf(path / "whole.gguf")
        path = path / "model.gguf"
        path.write_bytes(whole.read_bytes()[: whole.stat().st_size * 2 // 3])  # its metadata whole
    elif kind == "weights of the wrong shape":
        tiny_model_folder(path, tiny_tokenizer())
        tiny_model_folder(path / "wider", tiny_tokenizer(), hidden_size=64)
        (path / "wider" / "model.safetensors").replace(path / "model.safetensors")
    elif kind == "no tokenizer":
        tiny_model_folder(path, tiny_tokenizer())
        for file in path.iterdir():
            if file.name.startswith(("tokenizer", "chat_template")):
                file.unlink()
    return path


@pytest.mark.parametrize("kind,message", [
    ("config field of the wrong type",
     "bad config.json: Validation error for field 'hidden_size': TypeError: Field 'hidden_size' expected int, got str"),
    ("not a gguf", "is not a GGUF file (it does not start with the GGUF magic bytes)"),
    ("truncated gguf", "is truncated: 15 bytes, shorter than a GGUF header"),
    ("gguf cut short in its weights", "lie past the file's end ("),
    ("weights of the wrong shape", "its weights do not have the shapes its config.json gives"),
    ("no tokenizer", "has no tokenizer in it (none of tokenizer.json, tokenizer.model"),
])
def test_broken_model_is_one_line_error(tmp_path, kind, message):
    model = broken_model(kind, tmp_path)
    r = ladechat("ask", "--model", str(model), "--max-new-tokens", "4", "hi",
                 env_extra={"HF_HUB_OFFLINE": "1", "XDG_CACHE_HOME": str(tmp_path / "cache")})
    err = r.stderr.decode().strip()
    assert r.returncode == 1
    assert err.startswith((f"ladechat: error: {model}", f"ladechat: error: cannot load model {model}",
                           f"ladechat: error: cannot read {model}"))
    assert message in err and "\n" not in err and "Traceback" not in err


def test_bitsandbytes_on_a_gguf_file_is_one_line(tmp_path):
    from test_int4 import write_tiny_gguf

    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    r = ladechat("ask", "--model", str(path), "--load-in-4bit", "--max-new-tokens", "4", "hi",
                 env_extra={"XDG_CACHE_HOME": str(tmp_path / "cache")})
    err = r.stderr.decode().strip()
    assert r.returncode == 1 and "\n" not in err and "Traceback" not in err
    assert err == ("ladechat: error: tiny.gguf is a GGUF file, already quantized: --load-in-4bit and --load-in-8bit "
                   "take a Hugging Face model (its own blocks run at their bits here)")


@pytest.mark.parametrize("line,message", [
    ('{"turns": ["Hi"]', "line 2: not valid JSON (Expecting ',' delimiter)"),
    ('{"prompt": "Hi"}', 'line 2: an item needs "turns", a non-empty list of strings'),
    ('{"turns": "Hi"}', 'line 2: an item needs "turns", a non-empty list of strings'),
    ('["Hi"]', 'line 2: an item needs "turns", a non-empty list of strings'),
])
def test_bench_bad_dataset_is_one_line_error(tmp_path, line, message):
    from tiny_models import tiny_tokenizer

    folder = tiny_model_folder(tmp_path / "model", tiny_tokenizer())
    data = tmp_path / "set.jsonl"
    data.write_text('{"turns": ["Hello"]}\n' + line + "\n")
    r = ladechat("bench", "--dataset", str(data), "--methods", "plain", "--model", str(folder), "--dtype", "float32",
                 "--max-new-tokens", "4")
    err = r.stderr.decode().strip()
    assert r.returncode == 1 and "Traceback" not in err and "\n" not in err
    assert err == f"ladechat: error: {data}, {message}"


def test_bench_runs_every_method_against_hf(tmp_path):
    """A real bench run on a tiny model folder: hf joins as the reference even when listed last or
    not at all, and hf-packed (HF greedy on the packed weights ladechat's methods run) second; fp32
    answers of every method are identical to them, the per-item distribution is reported, and
    --single-turn answers only first turns."""
    from tiny_models import tiny_tokenizer

    folder = tiny_model_folder(tmp_path / "model", tiny_tokenizer())
    data = tmp_path / "set.jsonl"
    data.write_text('{"turns": ["Hello there, how are you?", "And then?"]}\n{"turns": ["def f(x): return x"]}\n')
    common = ("--dataset", str(data), "--model", str(folder), "--dtype", "float32", "--max-new-tokens", "12",
              "--json")
    # hf-packed listed last still runs second, before the answers compared with it
    r = ladechat("bench", "--methods", "lookahead,plain,hf-lookup-3" + (",hf-packed" if PACKED else ""), *common)
    assert r.returncode == 0, r.stderr
    results = json.loads(r.stdout)
    overall = results["overall"]
    assert results["packed_weights"] is PACKED
    assert list(overall) == HF_REFERENCES + ["lookahead", "plain", "hf-lookup-3"]
    for method, row in overall.items():
        assert row["items"] == 2 and row["tokens"] == overall["hf"]["tokens"]
        assert row["identical_items"] == 2, method
        if method in ("hf", "hf-lookup-3"):  # on the weights as loaded (packed fp32 sums differ in the last bits)
            assert row["identical_to_hf_items"] == 2, method
        assert row["item_geomean_vs_hf"] > 0 and row["item_p10_vs_hf"] <= row["item_geomean_vs_hf"] * 1.0001
        assert 0 <= row["items_slower_than_hf"] <= 2
    assert overall["hf"]["item_geomean_vs_hf"] == 1.0
    single = json.loads(ladechat("bench", "--methods", "plain", "--single-turn", *common).stdout)
    assert single["single_turn"] and 2 <= single["overall"]["plain"]["tokens"] < overall["plain"]["tokens"]


def test_bench_ablation_and_warm_store(tmp_path):
    """--ablation runs each draft source alone (all identical to hf) and prints its table; --store
    warm fills the stores from another prompt set first and refuses one that shares prompts."""
    from tiny_models import tiny_tokenizer

    folder = tiny_model_folder(tmp_path / "model", tiny_tokenizer())
    data, other = tmp_path / "set.jsonl", tmp_path / "other.jsonl"
    data.write_text('{"turns": ["Hello there, how are you?"]}\n{"turns": ["def f(x): return x"]}\n')
    other.write_text('{"turns": ["Tell me a story."]}\n{"turns": ["Hello there, how are you?"]}\n')
    common = ("--dataset", str(data), "--model", str(folder), "--dtype", "float32", "--max-new-tokens", "12")
    r = ladechat("bench", "--methods", "lookahead", "--ablation", "--store", "warm", "--warm-from", str(other),
                 "--warm-limit", "1", "--json", *common)
    assert r.returncode == 0, r.stderr
    results = json.loads(r.stdout)
    assert results["store"] == "warm" and results["warm_answers"] == 1
    overall = results["overall"]
    # on packed weights (an x86-64 CPU) hf-packed joins second, the reference of ladechat's answers
    assert list(overall) == HF_REFERENCES + ["lookahead", "only-context", "only-store", "only-window",
                                             "only-recycle"]
    for method, row in overall.items():
        assert row["identical_items"] == 2, method
        if method not in ("hf", "hf-packed"):
            assert row["steps"] >= 1 and row["ms_per_step"] > 0 and isinstance(row["accepted_by_depth"], list)
    table = ladechat("bench", "--methods", "lookahead", "--ablation", "--store", "off", *common)
    assert table.returncode == 0 and "ablation" in table.stdout.decode() and "recycle" in table.stdout.decode()
    shared = ladechat("bench", "--methods", "lookahead", "--store", "warm", "--warm-from", str(other), *common)
    err = shared.stderr.decode().strip()
    assert shared.returncode == 1 and err.endswith("--warm-from shares prompts with the measured items; "
                                                   "warm the store on a different set")
    bad = ladechat("bench", "--methods", "lookahead", "--store", "warm", *common)
    assert bad.returncode == 1 and "--store warm needs --warm-from" in bad.stderr.decode()


def test_store_is_kept_listed_and_cleared(tmp_path):
    """ask adds its answer to the model's store under the cache folder; --no-store does not;
    `ladechat store list` shows it and `store clear` deletes it (unknown model: one-line error)."""
    from tiny_models import tiny_tokenizer

    folder = tiny_model_folder(tmp_path / "model", tiny_tokenizer())
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache")}
    common = ("--model", str(folder), "--dtype", "float32", "--max-new-tokens", "6")
    empty = ladechat("store", "list", env_extra=env)
    assert empty.returncode == 0 and empty.stdout == b"" and b"no stores yet" in empty.stderr
    assert ladechat("ask", "hello", "--no-store", *common, env_extra=env).returncode == 0
    assert ladechat("store", "list", env_extra=env).stdout == b""
    for _ in range(2):
        assert ladechat("ask", "hello", *common, env_extra=env).returncode == 0
    [line] = ladechat("store", "list", env_extra=env).stdout.decode().splitlines()
    name, answers = line.split("\t")[:2]
    assert answers == "2 answers" and name.endswith("model")
    missing = ladechat("store", "clear", "--model", "nope", env_extra=env)
    assert missing.returncode == 1 and missing.stderr.decode().strip() == \
        "ladechat: error: no store for model 'nope' (see: ladechat store list)"
    cleared = ladechat("store", "clear", "--model", name, env_extra=env)
    assert cleared.returncode == 0 and b"deleted 1 store (2 answers)" in cleared.stderr
    assert ladechat("store", "list", env_extra=env).stdout == b""
