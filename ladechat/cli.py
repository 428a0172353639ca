"""Command line: `ladechat` (chat), `ladechat ask`, `ladechat serve`, `ladechat bench`, `ladechat templates`,
`ladechat store list|clear`, `ladechat ps`, `ladechat stop`."""

from __future__ import annotations

import functools
import inspect
import json
import os
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.markup import escape

from ladechat.backends.opener import compiles, load_model, open_bot, open_here, quiet_libraries, settings_for, warm_bot
from ladechat.engine.config import LookaheadConfig, SamplingConfig
from ladechat.errors import UserError
from ladechat.ui import terminal

# The settings' defaults are the engine configs' (no pydantic at import: --help stays quick), and
# max_new_tokens is each command's own: a chat's answers may run long; ask's is the settings'
# default; serve's is also the cap of every request; the bench's is what BENCHMARKS.md measures.
LOOKAHEAD = LookaheadConfig()
SAMPLING = SamplingConfig()
MAX_NEW_TOKENS = {"chat": 1024, "ask": SAMPLING.max_new_tokens, "serve": 1024, "bench": 256}
# The settings `ladechat bench` takes as flags (chat, ask and serve take every one).
BENCH_SETTINGS = ("window", "ngram", "candidates", "context_candidates", "context_len", "recycle", "max_new_tokens",
                  "temperature", "top_p", "top_k", "seed", "template")

app = typer.Typer(add_completion=False, no_args_is_help=False, rich_markup_mode=None,
                  pretty_exceptions_enable=False,
                  help="Chat with a local LLM in the terminal, faster with lookahead decoding.")


class Fail(UserError):
    """A flag the command line itself refuses (one line, exit status 1)."""


# Options shared by chat, ask and bench. Each is declared once here and reused.
Model = Annotated[Optional[str], typer.Option("--model", "-m", help="Hugging Face id, local folder or .gguf file (default: the embedded SmolLM2-135M-Instruct).")]
Lookahead = Annotated[bool, typer.Option("--lookahead/--no-lookahead", help="Lookahead decoding on or off (off: plain one-token decoding).")]
Window = Annotated[Optional[int], typer.Option("--window", "-W", help="Lookahead window width W (default: chosen for the device).")]
Ngram = Annotated[Optional[int], typer.Option("--ngram", "-N", help="n-gram size N (>= 2).")]
Cands = Annotated[Optional[int], typer.Option("--candidates", "-G", help="Candidate n-grams verified per step and kept per key, G (>= 0).")]
ContextCands = Annotated[Optional[int], typer.Option("--context-candidates", help="Continuations found by matching the conversation's last tokens, tried per step (default: chosen for the device).")]
ContextLen = Annotated[Optional[int], typer.Option("--context-len", help="Tokens one such context continuation proposes.")]
Recycle = Annotated[Optional[int], typer.Option("--recycle", help="Most draft nodes per step from the model's recycled top-k (0: none).")]
MaxNew = Annotated[int, typer.Option("--max-new-tokens", help="Most tokens in one answer.")]
Temperature = Annotated[Optional[float], typer.Option("--temperature", "-t", help="Sampling temperature; 0 is greedy.")]
TopP = Annotated[float, typer.Option("--top-p", help="Nucleus sampling: keep the smallest set of tokens with this much probability.")]
TopK = Annotated[int, typer.Option("--top-k", help="Sample among the K most likely tokens only (0: no limit).")]
MinP = Annotated[float, typer.Option("--min-p", help="Drop tokens less likely than min-p times the most likely one.")]
RepPenalty = Annotated[float, typer.Option("--repetition-penalty", help="Penalise tokens already in the conversation (1.0: off).")]
Seed = Annotated[Optional[int], typer.Option("--seed", help="Random seed for sampling (same seed, same answer).")]
Dtype = Annotated[str, typer.Option("--dtype", help="auto, float32, bfloat16 or float16 (auto: bf16 on GPUs and CPUs with native bf16, else fp32; fp32 for a GGUF's 4-bit blocks on ladechat's CPU kernels).")]
Device = Annotated[str, typer.Option("--device", help="auto, cpu, cuda or cuda:N.")]
FourBit = Annotated[bool, typer.Option("--load-in-4bit", help="Quantize weights to 4 bits with bitsandbytes.")]
EightBit = Annotated[bool, typer.Option("--load-in-8bit", help="Quantize weights to 8 bits with bitsandbytes.")]
DeviceMap = Annotated[Optional[str], typer.Option("--device-map", help="accelerate device map, e.g. 'auto' to spread a large model over GPUs and CPU memory.")]
MaxMemory = Annotated[Optional[str], typer.Option("--max-memory", help="With --device-map: memory per device, e.g. '0=20GiB,cpu=64GiB'; what fits nowhere is offloaded to disk.")]
Attn = Annotated[str, typer.Option("--attn", help="Attention kernel: sdpa, eager or flash.")]
ContextSize = Annotated[Optional[int], typer.Option("--ctx", help="Most tokens a conversation holds, the answer included (default: the model's context, at most 8192); the oldest turns are dropped past it.")]
Weights = Annotated[str, typer.Option("--weights", help="Linear weights: auto (a GGUF's 4-bit blocks as int4 on the CPU, the rest packed for oneDNN; else packed where that runs), dense (as transformers loads them), packed (oneDNN's layout, fp32/bf16) or int4.")]
Quantize = Annotated[Optional[str], typer.Option("--quantize", help="On the CPU, quantize a Hugging Face model's Linear weights as it loads: q4 (Q4_0 blocks) or q8 (Q8_0), run on ladechat's kernels like a GGUF's; kept in the cache, so only the first load quantizes.")]
Template = Annotated[Optional[str], typer.Option("--template", help="Chat template to use instead of the model's own (see: ladechat templates).")]
System = Annotated[Optional[str], typer.Option("--system", "-s", help="System prompt.")]
Stop = Annotated[Optional[list[str]], typer.Option("--stop", help="Stop the answer after this text (repeatable).")]
Compile = Annotated[bool, typer.Option("--compile", help="Fixed-shape steps on a pre-allocated KV cache, compiled with torch.compile (CUDA graphs on a GPU); every lookahead step is a full one. Compiles at start.")]
AutoCompile = Annotated[Optional[bool], typer.Option("--compile/--no-compile", show_default=False, help="Fixed-shape steps on a pre-allocated KV cache, compiled with torch.compile (CUDA graphs on a GPU); every lookahead step is a full one. Compiles at start (~30-50 s on a GPU). Default: on for a model on one NVIDIA GPU without --load-in-4bit/8bit or --device-map (uncompiled steps there if it fails, with a notice), off elsewhere.")]
Format = Annotated[Optional[str], typer.Option("--format", help="json: each answer is one JSON object, held to it token by token (ask's --json-schema: one of a schema).")]
Store = Annotated[bool, typer.Option("--store/--no-store", help="Draft from (and add each answer to) this model's store of past answers, kept under the cache folder (see: ladechat store).")]
HideThinking = Annotated[bool, typer.Option("--hide-thinking", help="Leave a reasoning model's <think>...</think> off the screen (shown dim otherwise; never kept in the conversation; ask --json gives it as 'reasoning').")]
Markdown = Annotated[bool, typer.Option("--markdown/--no-markdown", help="On a terminal, redraw a finished answer that has code blocks, lists or headings as rendered Markdown.")]
ServeMaxNew = Annotated[int, typer.Option("--max-new-tokens", help="Most tokens in one answer: the default, and a cap (a request asking for more gets this many).")]
AsJson = Annotated[bool, typer.Option("--json", help="Print one JSON object (text, token_ids, stats) instead of streaming.")]
Debug = Annotated[bool, typer.Option("--debug", help="Show per-step acceptance and a per-turn statistics panel on stderr.")]
Api = Annotated[str | None, typer.Option("--api", help="Answer with the model behind an OpenAI-compatible server at URL (ladechat serve, vLLM, ...) instead of loading one; --model then names the server's model.")]
ApiKey = Annotated[str | None, typer.Option("--api-key", envvar=["LADECHAT_API_KEY", "OPENAI_API_KEY"], show_envvar=True, help="With --api: the server's API key.")]
KeepHistory = Annotated[bool, typer.Option("--history/--no-history", envvar="LADECHAT_HISTORY", show_envvar=True, help="Keep this chat as it goes, in a private file under the state folder (see: ladechat history).")]
Continue = Annotated[bool, typer.Option("--continue", "-c", help="Go on with the last chat kept (its conversation and settings).")]
Resume = Annotated[bool, typer.Option("--resume", help="List the chats kept and open the one you choose.")]
KeepAlive = Annotated[str, typer.Option("--keep-alive", envvar="LADECHAT_KEEP_ALIVE", show_envvar=True, help="How long the model stays loaded after an answer, in a local server the next ask or chat uses (5m, 30s, 1h30m; 0: load in this command and keep nothing; -1: until 'ladechat stop').")]


def _shared(name: str, annotation, default) -> inspect.Parameter:
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=annotation, default=default)


# The parameters chat, ask and serve share, each group declared once (with_shared).
# What to load and how (engine/load/spec.py's LoadSpec) and whether the steps are compiled.
LOAD_PARAMETERS = (
    _shared("model", Model, None), _shared("dtype", Dtype, "auto"), _shared("device", Device, "auto"),
    _shared("load_in_4bit", FourBit, False), _shared("load_in_8bit", EightBit, False),
    _shared("device_map", DeviceMap, None), _shared("max_memory", MaxMemory, None), _shared("attn", Attn, "sdpa"),
    _shared("weights", Weights, "auto"), _shared("context_size", ContextSize, None),
    _shared("quantize", Quantize, None), _shared("compile", AutoCompile, None))


def setting_parameters(max_new_tokens: int, max_new_option=MaxNew) -> tuple[inspect.Parameter, ...]:
    """Every setting (ladechat/settings.py) as a flag, with the command's own most new tokens."""
    return (_shared("lookahead", Lookahead, LOOKAHEAD.enabled), _shared("window", Window, None),
            _shared("ngram", Ngram, None), _shared("candidates", Cands, None),
            _shared("context_candidates", ContextCands, None), _shared("context_len", ContextLen, None),
            _shared("recycle", Recycle, None), _shared("max_new_tokens", max_new_option, max_new_tokens),
            _shared("temperature", Temperature, None), _shared("top_p", TopP, SAMPLING.top_p),
            _shared("top_k", TopK, SAMPLING.top_k), _shared("min_p", MinP, SAMPLING.min_p),
            _shared("repetition_penalty", RepPenalty, SAMPLING.repetition_penalty), _shared("seed", Seed, None),
            _shared("stop", Stop, None), _shared("template", Template, None), _shared("store", Store, LOOKAHEAD.store),
            _shared("format", Format, None))


# Where the model answers, for the commands that may answer through a server (chat, ask).
CLIENT_PARAMETERS = (_shared("api", Api, None), _shared("api_key", ApiKey, None), _shared("keep_alive", KeepAlive, "5m"))
# How an answer is shown (chat, ask).
OUTPUT_PARAMETERS = (_shared("system", System, None), _shared("markdown", Markdown, True),
                     _shared("hide_thinking", HideThinking, False), _shared("debug", Debug, False))


def with_shared(*groups: tuple[inspect.Parameter, ...]):
    """A command that takes these shared parameters besides its own: typer reads them from its
    signature, after the command's own (a parameter the command declares itself is its own), and
    the command reads the ones it uses from ctx.params; Spec.of reads them all."""
    def wrap(command):
        own = inspect.signature(command, eval_str=True)
        extra = [p for group in groups for p in group if p.name not in own.parameters]

        @functools.wraps(command)
        def run(*args, **kwargs):
            return command(*args, **{name: value for name, value in kwargs.items() if name in own.parameters})

        run.__signature__ = own.replace(parameters=[*own.parameters.values(), *extra])
        return run
    return wrap


def stdout_console() -> Console:
    return terminal.SafeConsole(no_color=bool(os.environ.get("NO_COLOR")) or None, highlight=False)


def stderr_console() -> Console:
    return terminal.SafeConsole(stderr=True, no_color=bool(os.environ.get("NO_COLOR")) or None, highlight=False)


def _spec(ctx: typer.Context, defaults: dict | None = None, keep_alive: float = 0.0, names: tuple[str, ...] | None = None,
          **changes):
    """The command's spec (backends/spec.py) from its parameters, `changes` replacing some (a
    change that is not None counts as given): every flag checked, one line for a bad one, before
    anything slow starts."""
    from ladechat.backends.spec import Spec

    given = _given(ctx) | {name for name, value in changes.items() if value is not None}
    return Spec.of({**ctx.params, **changes}, given, defaults, keep_alive, names)


def _spinner(err: Console):
    """progress(message) for load(): a spinner on stderr while a slow phase runs."""
    from ladechat.ui.phase import phases

    return phases(err)


def _print_notices(notices, err: Console) -> None:
    for notice in notices:
        # soft_wrap: a notice stays one line in a pipe or a log (the terminal wraps it on screen)
        err.print(f"[yellow]notice:[/] {escape(notice)}", highlight=False, soft_wrap=True)


def _load_here(load_spec, err: Console, compile: bool = False):
    """The model of this LoadSpec in the foreground: a spinner on stderr while it loads, then its
    notices."""
    loaded = load_model(load_spec, _spinner(err), compile)
    _print_notices(loaded.notices, err)
    return loaded


def _given(ctx: typer.Context) -> set[str]:
    """The parameters the user gave (on the command line or through an environment variable)."""
    # typer vendors its own click: its ParameterSource is compared by name
    return {name for name in ctx.params
            if getattr(ctx.get_parameter_source(name), "name", "DEFAULT") not in ("DEFAULT", "DEFAULT_MAP")}


def _keep_alive(text: str) -> float:
    """--keep-alive / LADECHAT_KEEP_ALIVE in seconds (negative: forever); WarmError for a bad one."""
    from ladechat.keepalive.runtime import parse_duration

    return parse_duration(text)


def _runtime_root():
    """The folder of this user's warm servers (LADECHAT_RUNTIME_DIR, else the runtime folder)."""
    from ladechat.keepalive.runtime import runtime_root

    return runtime_root(os.environ)


@app.callback(invoke_without_command=True)
@with_shared(LOAD_PARAMETERS, setting_parameters(MAX_NEW_TOKENS["chat"]), CLIENT_PARAMETERS, OUTPUT_PARAMETERS)
def chat(ctx: typer.Context, history: KeepHistory = True, continue_: Continue = False, resume: Resume = False) -> None:
    """Interactive multi-turn chat (the default command). Type /help inside for commands."""
    if ctx.invoked_subcommand is not None:
        return
    from functools import partial

    from ladechat.ui.chat import run_chat

    err = stderr_console()
    log, reopen = _chat_log(history, continue_, resume, err)
    if reopen is not None:  # a kept chat that does not read is its one line, before the model loads
        from ladechat.conversation import Conversation

        Conversation.from_file(reopen)
    flags = ctx.params
    spec = _spec(ctx, keep_alive=_keep_alive(flags["keep_alive"]))

    def switch(name: str):
        """/model NAME: the bot of another model, opened as this chat's was (--api, keep-alive or here)."""
        bot = open_bot(spec.with_model(name), _spinner(err))
        if spec.api is None and spec.keep_alive != 0:  # now, one line each (else the first answer's events show them)
            _print_notices(bot.notices, err)
            bot.notices.clear()
        return bot

    run_chat = partial(run_chat, log=log, reopen=reopen, switch=switch, system=flags["system"], debug=flags["debug"],
                       markdown=flags["markdown"], hide_thinking=flags["hide_thinking"], out=stdout_console(), err=err)
    from ladechat.backends.pending import LoadFailed, PendingBot

    # a warm server that expires mid-chat is started again under the chat's own spinner
    load = lambda progress: open_bot(spec, progress, again=_spinner(err))
    if spec.api is not None:
        run_chat(open_bot(spec, _spinner(err)))
        return
    if spec.keep_alive != 0:  # the model in a local server that keeps it loaded for the next commands
        warm = warm_bot(spec, _spinner(err), start=False)  # one that holds it already
        if warm is not None:
            run_chat(warm)
            return
    elif compiles(spec):
        # Compiled steps are captured (CUDA graphs) per thread: warm them up on the thread that
        # answers, before the prompt.
        run_chat(open_bot(spec, _spinner(err)))
        return
    # The prompt comes at once; the model loads meanwhile and the first answer waits for it.
    bot = PendingBot(load, label=spec.load.model or "the embedded model", err=err)
    try:
        run_chat(bot)
    except LoadFailed as exc:
        raise Fail(str(exc)) from None
    if not bot.settled:
        # Left before the load ended. Interpreter shutdown would stop the loading thread wherever
        # it is, possibly inside torch's or safetensors' native code (an abort at exit); the
        # conversation is not kept past the chat and the input history is written line by line,
        # so end here, with nothing lost.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def _chat_log(keep: bool, latest: bool, pick: bool, err: Console):
    """(where the chat is kept or None, the kept chat to reopen or None) for --history,
    --continue and --resume."""
    from ladechat.ui.history import ChatLog, chats_root, find_chat, list_chats

    if (latest or pick) and not keep:
        raise Fail(f"{'--continue' if latest else '--resume'} opens a kept chat, and --no-history (or LADECHAT_HISTORY) "
                   "turns keeping them off")
    if latest and pick:
        raise Fail("--continue opens the last chat and --resume the one you choose: give one of them")
    root = chats_root()
    if latest:
        return ChatLog(root), find_chat(root, "1")
    if not pick:
        return (ChatLog(root) if keep else None), None
    chats = list_chats(root)
    if not chats:
        raise Fail("no chats have been kept yet")
    if not sys.stdin.isatty():
        raise Fail("--resume asks which chat to open, and the input is not a terminal: use --continue for the last "
                   "one, or /history N in the chat")
    for number, chat in enumerate(chats[:20], 1):
        err.print(chat.line(number), highlight=False, markup=False, soft_wrap=True)
    try:
        choice = input("open which chat (number or id; Enter: a new chat)? ").strip()
    except EOFError:
        choice = ""
    return ChatLog(root), (find_chat(root, choice) if choice else None)


@app.command()
def history(chat: Annotated[Optional[str], typer.Argument(help="A kept chat: its number in the listing (1: the newest) or its id. Without it: the listing.")] = None,
            as_json: Annotated[bool, typer.Option("--json", help="Print the chat as JSON (the /save format, which /load reads) instead of Markdown.")] = False,
            delete: Annotated[bool, typer.Option("--delete", help="Delete the chat instead of printing it.")] = False) -> None:
    """The chats kept as they went (newest first), or one of them as Markdown or JSON."""
    from ladechat.conversation import Conversation, read_json_file
    from ladechat.ui.history import chats_root, find_chat, list_chats, markdown

    root = chats_root()
    if chat is None:
        if as_json or delete:
            raise Fail("--json and --delete act on one chat: name it (ladechat history N)")
        chats = list_chats(root)
        if not chats:
            stderr_console().print(f"no chats kept yet (they are kept in {root})", highlight=False, markup=False)
        for number, saved in enumerate(chats, 1):
            terminal.write(saved.line(number) + "\n")
        return
    path = find_chat(root, chat)
    if delete:
        try:
            path.rmdir() if path.is_dir() and not path.is_symlink() else path.unlink()
        except OSError as exc:
            raise Fail(f"cannot delete {path}: {exc.strerror or exc}") from None
        path.with_name(f".{path.stem}.lock").unlink(missing_ok=True)
        stderr_console().print(f"deleted chat {path.stem}", highlight=False, markup=False)
    elif as_json:  # as the chat wrote it (and /load reads it), once it reads as a chat
        data = read_json_file(path)
        Conversation.from_data(data, path)
        sys.stdout.write(terminal.json_text(data, indent=2) + "\n")
    else:
        terminal.write(markdown(path))


@app.command()
@with_shared(LOAD_PARAMETERS, setting_parameters(MAX_NEW_TOKENS["ask"]), CLIENT_PARAMETERS, OUTPUT_PARAMETERS)
def ask(ctx: typer.Context, prompt: Annotated[Optional[str], typer.Argument(help="The question; '-' or a pipe reads it from stdin.")] = None,
        as_json: AsJson = False,
        files: Annotated[Optional[list[str]], typer.Option("--file", "-f", help="A text file to put into the question, under its name (repeatable); with no PROMPT the files are the question.")] = None,
        json_schema: Annotated[Optional[str], typer.Option("--json-schema", help="A JSON Schema (a file, or its JSON text): the answer is one JSON document of it.")] = None) -> None:
    """One-shot answer to PROMPT, streamed to stdout (greedy unless --temperature is given)."""
    from ladechat.backends.base import interrupt
    from ladechat.backends.events import Notice
    from ladechat.conversation import Conversation
    from ladechat.engine.events import Done
    from ladechat.ui.files import attachment, with_attachments
    from ladechat.ui.stream import StreamPrinter, debug_panel, failure, footer
    from ladechat.ui.thinking import split as split_thinking

    err = stderr_console()
    attached = [attachment(path) for path in files or []]  # before any load: a bad file is one line
    text = with_attachments(attached, _read_prompt(prompt, files_only=bool(attached)))
    flags = ctx.params
    keep_alive = _keep_alive(flags["keep_alive"]) if flags["api"] is None else 0.0
    answer_format = _answer_format(flags["format"], json_schema)
    spec = _spec(ctx, defaults={"temperature": 0.0}, keep_alive=keep_alive, format=answer_format)
    bot = open_bot(spec, _spinner(err))  # greedy unless --temperature
    if spec.api is None:  # now, one line each
        _print_notices(bot.notices, err)
        bot.notices.clear()
    debug = flags["debug"]
    if debug:  # which weights and kernels answer
        err.print(f"[dim]model {escape(bot.describe())}[/]", highlight=False, soft_wrap=True)
    conversation = Conversation(system=flags["system"], messages=[{"role": "user", "content": text}])
    out = stdout_console()
    # a document is printed as the model wrote it, never as markdown
    printer = StreamPrinter(out, err, debug=debug, markdown=flags["markdown"] and answer_format is None,
                            hide_thinking=flags["hide_thinking"])
    done = None
    interrupted = False  # Ctrl-C reached this loop (after the answer's Done too: still exit 130)
    events = bot.reply(conversation)
    try:
        for event in events:
            if isinstance(event, Done):
                done = event
            elif not as_json or isinstance(event, Notice):
                printer.handle(event)
    except Exception as exc:  # out of memory, a server gone (a UserError goes on to main())
        message = failure(exc)
        if message is None:
            raise
        if printer.text:
            out.print()
        raise Fail(message) from None
    except KeyboardInterrupt:  # while an event was printed: the stream ends as if it had landed there
        interrupted = True
        done = interrupt(events) if done is None else done
        if done is None:
            err.print("\n[yellow]interrupted[/]")
            raise typer.Exit(130) from None
    if done is None:
        raise Fail("generation ended without a result")
    stats = done.stats
    if as_json:
        reasoning, answer = split_thinking(done.text)
        record = {"text": answer, "token_ids": list(done.text_tokens), "model": bot.name, "stats": stats.as_dict()}
        if reasoning:
            record["reasoning"] = reasoning
        sys.stdout.write(terminal.json_text(record) + "\n")
    else:
        printer.finish(complete=stats.finish_reason != "interrupted")
        if debug and bot.stats_reported:
            err.print(debug_panel(stats))
        err.print(f"[dim]{escape(footer(stats, bot))}[/]", highlight=False, soft_wrap=True)  # one line, piped too
    if interrupted or stats.finish_reason == "interrupted":
        raise typer.Exit(130)
    if answer_format is not None and stats.finish_reason == "length":
        raise Fail(f"the answer reached its {stats.new_tokens} tokens (--max-new-tokens) before its JSON document "
                   "was complete: what was printed is not a whole document")


def _answer_format(given: str | None, json_schema: str | None) -> str | None:
    """Settings.format from ask's --format and --json-schema (a file, or the schema's JSON text)."""
    if json_schema is None:
        if given not in (None, "json"):
            raise Fail(f"--format must be json, got {given!r} (a schema: --json-schema FILE|JSON)")
        return given
    if given is not None:
        raise Fail("--format and --json-schema cannot go together (--json-schema's answers are JSON)")
    from ladechat.ui import files

    try:
        return files.json_schema(json_schema)
    except files.FileError as exc:
        raise Fail(f"--json-schema: {exc}") from None


def _read_prompt(prompt: str | None, files_only: bool = False) -> str:
    """The question from the argument or stdin. files_only: --file gave the message, so none is
    needed (and stdin is read only when '-' asks for it)."""
    if prompt is None and files_only:  # stdin (a loop's list, say) is not the question unless '-' says so
        return ""
    if prompt is None and sys.stdin.isatty():
        raise Fail("no prompt: give it as an argument, or pipe it in (e.g. echo hi | ladechat ask)")
    if prompt is None or prompt == "-":
        data = sys.stdin.buffer.read()
        try:
            prompt = data.decode("utf-8")
        except UnicodeDecodeError:
            raise Fail("stdin is not valid UTF-8 text") from None
        if "\x00" in prompt:
            raise Fail("stdin looks binary (it contains NUL bytes); pass text")
    if not prompt.strip():
        if files_only:
            return ""
        raise Fail("empty prompt")
    return prompt.strip("\n")


def _key_from(path: Path) -> str:
    """The API key in the first line of `path` (one-line errors for a missing, unreadable or empty file)."""
    if path.is_dir():
        raise Fail(f"--api-key-file: {path} is a folder")
    try:
        with open(path, encoding="utf-8") as file:
            key = file.readline(4096).strip()
    except FileNotFoundError:
        raise Fail(f"--api-key-file: no such file: {path}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise Fail(f"--api-key-file: cannot read {path}: {getattr(exc, 'strerror', None) or exc}") from None
    if not key:
        raise Fail(f"--api-key-file: {path} holds no key on its first line")
    return key


@app.command()
@with_shared(LOAD_PARAMETERS, setting_parameters(MAX_NEW_TOKENS["serve"], ServeMaxNew))
def serve(ctx: typer.Context, host: Annotated[str, typer.Option("--host", help="Address to listen on; anything but loopback needs --api-key.")] = "127.0.0.1",
          port: Annotated[int, typer.Option("--port", help="Port to listen on (0: a free one, printed at start).")] = 8000,
          api_key: Annotated[str | None, typer.Option("--api-key", envvar="LADECHAT_API_KEY", show_envvar=True, help="Clients must send 'Authorization: Bearer KEY'.")] = None,
          max_queue: Annotated[int, typer.Option("--max-queue", help="Requests that may wait while one runs; more get 503 with Retry-After.")] = 16,
          served_model_name: Annotated[str | None, typer.Option("--served-model-name", help="The model name clients ask for (default: the model's).")] = None,
          allow_origin: Annotated[Optional[list[str]], typer.Option("--allow-origin", help="A web origin (e.g. http://localhost:3000, or * for any) whose pages may use the server (repeatable); requests from other sites' pages get 403.")] = None,
          drain_timeout: Annotated[float, typer.Option("--drain-timeout", help="On SIGTERM or Ctrl-C: seconds the answers in progress get to finish; then each ends with an error (event).")] = 5.0,
          request_timeout: Annotated[float, typer.Option("--request-timeout", help="Seconds a connection has to send a whole request; an idle or half-sent one is closed then.")] = 30.0,
          api_key_file: Annotated[Optional[Path], typer.Option("--api-key-file", help="Read the API key from this file's first line (unlike --api-key, not shown in ps).")] = None) -> None:
    """Serve the model over an OpenAI-compatible HTTP API (/v1/chat/completions), with lookahead decoding."""
    from ladechat.serve import app as server
    from ladechat.serve.guard import allowed_hosts, is_loopback, normal_origin

    err = stderr_console()
    if api_key_file is not None:  # over LADECHAT_API_KEY (a client's too), not beside --api-key
        if api_key is not None and ctx.get_parameter_source("api_key").name == "COMMANDLINE":
            raise Fail("give the API key once: --api-key-file or --api-key")
        api_key = _key_from(api_key_file)
    if not is_loopback(host) and not api_key:
        raise Fail(f"--host {host} can be reached from other machines: set LADECHAT_API_KEY or give --api-key-file "
                   "(or --api-key)")
    if max_queue < 0:
        raise Fail(f"--max-queue must be >= 0, got {max_queue}")
    if api_key is not None and not api_key.strip():
        raise Fail("--api-key is empty")
    if not drain_timeout >= 0 or drain_timeout == float("inf"):
        raise Fail(f"--drain-timeout must be a finite number of seconds >= 0, got {drain_timeout}")
    if not request_timeout > 0 or request_timeout == float("inf"):
        raise Fail(f"--request-timeout must be a finite number of seconds > 0, got {request_timeout}")
    try:
        origins = frozenset(normal_origin(o) for o in allow_origin or [])
    except ValueError as exc:
        raise Fail(f"--allow-origin: {exc}") from None
    spec = _spec(ctx)  # every flag checked before the (slow) model load
    try:
        sock = server.bind(host, port)
    except OSError as exc:
        raise Fail(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    from ladechat.serve.worker import ModelThread

    model_thread = ModelThread()  # compiled steps are warmed up where they will answer
    settings, bot = open_here(spec, _spinner(err), model_thread.run)
    _print_notices(bot.notices, err)
    bot.notices.clear()
    model_id = served_model_name or spec.load.model or bot.name.split(" (")[0]
    bound_host, bound_port = sock.getsockname()[:2]
    config = server.ServeConfig(model_id=model_id, api_key=api_key, max_queue=max_queue,
                                hosts=allowed_hosts(host, bound_host), origins=origins,
                                drain_timeout=drain_timeout, request_timeout=request_timeout)
    api = server.Api(bot, bot.loaded.tokenizer, bot.loaded.context_length, settings, config,
                     log=lambda line: err.print(line, markup=False, highlight=False, soft_wrap=True),
                     model_thread=model_thread)
    url_host = f"[{bound_host}]" if ":" in bound_host else bound_host
    server.listen(sock)
    err.print(f"ladechat serve · {bot.describe()} as {model_id!r} · lookahead {'on' if settings.lookahead else 'off'} "
              f"(W={settings.window} N={settings.ngram} G={settings.candidates}) · http://{url_host}:{bound_port}/v1"
              f"{' · key required' if api_key else ''} · Ctrl-C stops", markup=False, highlight=False, soft_wrap=True)
    server.run(api, sock)


@app.command()
def templates() -> None:
    """List the chat templates shipped with ladechat (for --template)."""
    from ladechat import templates as shipped

    for name in shipped.names():
        print(name)


HubModel = Annotated[str, typer.Argument(help="A GGUF on the Hugging Face hub: hf.co/ORG/REPO[:QUANT] or ORG/REPO:QUANT (QUANT: Q4_K_M when not named).")]


def _hub_ref(model: str) -> tuple[str, str]:
    from ladechat.engine.load.hub import gguf_ref

    ref = gguf_ref(model if ":" in model or model.startswith(("hf.co/", "huggingface.co/", "https://")) else
                   f"hf.co/{model}")
    if ref is None:
        raise Fail(f"not a hub GGUF: {model} (hf.co/ORG/REPO[:QUANT] or ORG/REPO:QUANT)")
    return ref


@app.command()
def pull(model: HubModel) -> None:
    """Download a GGUF from the Hugging Face hub into its cache (resumed where a download stopped,
    checked against the hub's sha256); --model takes the same name."""
    from ladechat.engine.load import hub

    err = stderr_console()
    path = hub.fetch_shown(*_hub_ref(model), _spinner(err), refresh=True)
    err.print(f"{escape(model)}: {path.stat().st_size / 1e9:.2f} GB at {escape(str(path))}", highlight=False)


@app.command("models")
def models_list() -> None:
    """The GGUFs downloaded from the hub: name (as --model takes it), size, where they are."""
    from ladechat.engine.load import hub

    entries = hub.downloaded()
    if not entries:
        stderr_console().print("no models downloaded yet (ladechat pull hf.co/ORG/REPO:QUANT, or --model with such a name)")
    for entry in entries:
        terminal.write(f"hf.co/{entry.name}\t{entry.size / 1e9:.2f} GB\t{entry.paths[0]}\n")


@app.command("rm")
def remove_model(model: HubModel) -> None:
    """Delete a downloaded GGUF (its files in the hub cache) to free the disk."""
    from ladechat.engine.load import hub

    removed = hub.remove(*_hub_ref(model))
    stderr_console().print(f"removed {escape(model)} ({len(removed)} files)", highlight=False)


bench_app = typer.Typer(rich_markup_mode=None, help="Compare HF generate, HF prompt lookup, ladechat plain and lookahead on real prompts, side by side (and other engines' servers: --peer NAME=URL); subcommands: step-cost (what one step costs), serving (serving overhead).")
app.add_typer(bench_app, name="bench")
BenchJson = Annotated[bool, typer.Option("--json", help="Print the results as JSON.")]
Datasets = Annotated[list[str], typer.Option("--dataset", "-d", help="Prompt set: mtbench, humaneval, gsm8k (from ../shared/data) or a JSONL path; repeatable.")]
Limit = Annotated[Optional[int], typer.Option("--limit", help="Items per dataset (default: all).")]

# The forms of `ladechat bench` before its subcommands: the flag -> the subcommand now.
BENCH_FLAGS = {"--step-cost": "step-cost", "--api": "serving"}


@bench_app.callback(invoke_without_command=True)
def bench(ctx: typer.Context, dataset: Datasets = ["mtbench"],
          methods: Annotated[str, typer.Option("--methods", help="Comma-separated: hf (always run, the reference), hf-lookup-3, hf-lookup-5, hf-lookup (10 tokens), hf-static (HF generate on one static cache, compiled with --compile), hf-packed (HF greedy on ladechat's packed weights), plain, lookahead, lookahead-full.")] = "hf,hf-lookup-3,hf-lookup-5,hf-lookup,plain,lookahead",
          single_turn: Annotated[bool, typer.Option("--single-turn", help="Only the first turn of each item.")] = False,
          store: Annotated[str, typer.Option("--store", help="Each ladechat method's store of past answers: cold (empty at the start, filled as the run goes), warm (first filled with the answers to --warm-from) or off. Never the store of your chats.")] = "cold",
          warm_from: Annotated[Optional[list[str]], typer.Option("--warm-from", help="With --store warm: prompt set(s) whose answers fill the store first; must not share prompts with --dataset.")] = None,
          warm_limit: Annotated[Optional[int], typer.Option("--warm-limit", help="Items of each --warm-from set (default: all).")] = None,
          ablation: Annotated[bool, typer.Option("--ablation", help="Also run lookahead with each draft source alone (only-context, only-store, only-window, only-recycle) and print the ablation table.")] = False,
          peer: Annotated[Optional[list[str]], typer.Option("--peer", help="NAME=URL: an OpenAI-compatible server (llama.cpp's llama-server, vLLM, ...) answering the same prompts as one more method, NAME, with the same settings; its tokens are the server's usage (else its text tokenized here); never compared with hf's answers. Repeatable.")] = None,
          limit: Limit = None, model: Model = None, window: Window = None, ngram: Ngram = None, candidates: Cands = None,
          context_candidates: ContextCands = None, context_len: ContextLen = None, recycle: Recycle = None,
          max_new_tokens: MaxNew = MAX_NEW_TOKENS["bench"], temperature: Temperature = None, top_p: TopP = SAMPLING.top_p,
          top_k: TopK = SAMPLING.top_k, seed: Seed = 0, dtype: Dtype = "auto", device: Device = "auto",
          attn: Attn = "sdpa", template: Template = None, compile: Compile = False, as_json: BenchJson = False,
          weights: Annotated[Optional[str], typer.Option("--weights", help="Linear weights, as for the chat (auto, dense, packed, int4); default: the chat's own (auto), dense with --compile.")] = None) -> None:
    """Compare HF generate, HF prompt lookup, ladechat plain and lookahead on real prompts, side by side (and other engines' servers: --peer)."""
    if ctx.invoked_subcommand is not None:
        return
    from ladechat.bench import peers as peer_bench
    from ladechat.bench import prompts as benchmark
    from ladechat.ui.report import bench_tables

    err = stderr_console()
    # the bench's --store is a mode, not the setting; without --weights, the chat's own (dense with --compile)
    from ladechat.engine.load.loading import bench_weights

    spec = _spec(ctx, names=BENCH_SETTINGS, weights=weights or bench_weights(compile))
    method_list = [m.strip() for m in methods.split(",") if m.strip()] + (list(benchmark.ONLY) if ablation else [])
    benchmark.check_methods(method_list)
    for name in [*dataset, *(warm_from or [])]:
        benchmark.load_items(name, limit)  # a bad file fails now, not after loading the model
    if store not in benchmark.STORE_MODES:
        raise Fail(f"--store must be one of {', '.join(benchmark.STORE_MODES)}, got {store!r}")
    if (store == "warm") != bool(warm_from):
        raise Fail("--store warm needs --warm-from (a prompt set to build the store from), and only it")
    if limit is not None and limit < 1:
        raise Fail(f"--limit must be >= 1, got {limit}")
    # every flag checked, and every peer asked for its models, before the (slow) model load
    peers = peer_bench.connect(peer or [], set(benchmark.METHODS), settings_for(spec.given))
    quiet_libraries()
    loaded = _load_here(spec.load, err, compile)
    settings = settings_for(spec.given, loaded, compile=compile)
    results = benchmark.run(loaded, dataset, method_list, settings, limit, compile=compile, single_turn=single_turn,
                            store=store, warm_from=warm_from, warm_limit=warm_limit, peers=peers,
                            progress=lambda name, i, n: err.print(f"[dim]{escape(name)}: {i}/{n}[/]", highlight=False))
    if as_json:
        print(json.dumps(results, indent=2))
    else:
        out = stdout_console()
        for table in bench_tables(results):
            if not out.is_terminal:  # a pipe or a file: whole (rich would squeeze it into 80 columns)
                out.width = max(out.width, out.measure(table, options=out.options.update_width(1000)).maximum)
            out.print(table)


@bench_app.command("serving")
def bench_serving(ctx: typer.Context,
                  api: Annotated[str, typer.Option("--api", help="The ladechat serve to measure, started with the same --model and --dtype and with --no-store.")],
                  api_key: ApiKey = None, dataset: Datasets = ["mtbench"], limit: Limit = None, model: Model = None,
                  window: Window = None, ngram: Ngram = None, candidates: Cands = None,
                  context_candidates: ContextCands = None, context_len: ContextLen = None, recycle: Recycle = None,
                  max_new_tokens: MaxNew = MAX_NEW_TOKENS["bench"], temperature: Temperature = None,
                  top_p: TopP = SAMPLING.top_p, top_k: TopK = SAMPLING.top_k, seed: Seed = 0,
                  dtype: Dtype = "auto", device: Device = "auto", attn: Attn = "sdpa", template: Template = None,
                  as_json: BenchJson = False,
                  weights: Annotated[str, typer.Option("--weights", help="Linear weights, as for the chat (auto, dense, packed, int4); as ladechat serve loads them by default.")] = "auto") -> None:
    """Serving overhead: each prompt's first turn answered in this process and through the ladechat serve at --api URL, alternately."""
    from ladechat.backends.spec import Spec
    from ladechat.bench import prompts, serving
    from ladechat.ui.report import serve_bench_table

    err = stderr_console()
    spec = _spec(ctx, names=BENCH_SETTINGS, api=None, api_key=None)  # every flag checked before the (slow) model load
    texts = [item["turns"][0] for name in dataset for item in prompts.load_items(name, limit)]
    remote = open_bot(Spec(api=api, api_key=api_key), _spinner(err))  # sends no settings of its own
    serving.check_server(remote)  # before the (slow) model load
    quiet_libraries()
    loaded = _load_here(spec.load, err)
    settings = settings_for(spec.given, loaded)
    result = serving.run(loaded, settings, remote, texts, progress=lambda i, n: err.print(f"[dim]{i}/{n}[/]", highlight=False))
    if as_json:
        print(json.dumps(result, indent=2))
    else:
        stdout_console().print(serve_bench_table(result))


@bench_app.command("step-cost")
def bench_step_cost(model: Model = None,
                    shape: Annotated[Optional[str], typer.Option("--shape", help="A randomly initialised Llama of this shape instead of --model: llama-2-7b, llama-3-8b, smollm2-135m, tiny.")] = None,
                    sizes: Annotated[str, typer.Option("--sizes", help="Tokens fed per step, comma-separated (1 or multiples of 4).")] = "1,8,16,32,64,128,256",
                    context: Annotated[int, typer.Option("--context", help="Tokens already in the KV cache.")] = 512,
                    reps: Annotated[int, typer.Option("--reps", help="Timed steps per size (median).")] = 10,
                    compile: Compile = False, dtype: Dtype = "auto", device: Device = "auto", attn: Attn = "sdpa",
                    as_json: BenchJson = False,
                    weights: Annotated[Optional[str], typer.Option("--weights", help="Linear weights, as for the chat (auto, dense, packed, int4); default: the chat's own (auto), dense with --compile.")] = None,
                    show: Annotated[bool, typer.Option("--show", help="Print the step costs the chat plans with for --model on this machine (measured once, lowered by real steps), measuring nothing.")] = False,
                    reset: Annotated[bool, typer.Option("--reset", help="Forget the step costs kept for --model on this machine: its next chat measures them afresh.")] = False) -> None:
    """What one decoding step costs as it feeds more tokens (exact-size steps through the model's
    forward and, for the Llama family, engine/models/llama.py, on a GPU too; fixed-shape and --compile'd
    ones), next to HF generate's time per token. --show / --reset: the costs the chat keeps."""
    from ladechat.bench import steps
    from ladechat.engine.load.loading import bench_weights
    from ladechat.engine.load.placement import resolve_device, resolve_dtype
    from ladechat.engine.load.spec import LoadSpec
    from ladechat.ui.report import step_cost_table

    err = stderr_console()
    if show or reset:
        _kept_step_costs(model, dtype, device, attn, weights, show, reset, as_json, err)
        return
    size_list = steps.parse_sizes(sizes)
    if context < 1 or reps < 1:
        raise Fail(f"--context and --reps must be >= 1, got {context} and {reps}")
    if shape is not None and model is not None:
        raise Fail("give --model or --shape, not both")
    quiet_libraries()
    if shape is not None:
        dev = resolve_device(device)
        with _spinner(err)(f"building a random {shape} model on {dev}"):
            net = steps.random_model(shape, resolve_dtype(dtype, dev), dev, pack_weights=not compile)
            name = f"random {shape}"
    else:
        load = LoadSpec(model=model, dtype=dtype, device=device, attn=attn,
                        weights="dense" if compile else weights or bench_weights(compile))
        loaded = _load_here(load, err, compile)
        net, name = loaded.model, loaded.name
    with _spinner(err)("timing steps" + (" (compiling first)" if compile else "")):
        result = steps.run(net, name, size_list, context, reps, compile)
    if "llama_error" in result:
        err.print(f"notice: ladechat's Llama steps could not run here: {escape(result['llama_error'])}",
                  highlight=False)
    if as_json:
        print(json.dumps(result, indent=2))
    else:
        stdout_console().print(step_cost_table(result))


def _kept_step_costs(model: str | None, dtype: str, device: str, attn: str, weights: str | None, show: bool,
                     reset: bool, as_json: bool, err: Console) -> None:
    """`bench step-cost --show/--reset`: the step costs a chat on this model plans with, loaded as the
    chat loads it (they are kept per model, device, dtype and weight layout)."""
    from ladechat.engine import cost_envelope
    from ladechat.engine.load.spec import LoadSpec
    from ladechat.ui.report import kept_costs_table

    if show and reset:
        raise Fail("give --show or --reset, not both")
    quiet_libraries()
    loaded = _load_here(LoadSpec(model=model, dtype=dtype, device=device, attn=attn, weights=weights or "auto"), err)
    if loaded.device.type != "cpu":
        raise Fail(f"on {loaded.device.type} every lookahead step is a full one: no step costs are kept there")
    if reset:
        removed = cost_envelope.forget(loaded)
        err.print(f"forgot the step costs kept for {escape(loaded.name)}: its next chat measures them"
                  if removed else f"no step costs were kept for {escape(loaded.name)} on this machine",
                  highlight=False, soft_wrap=True)
        from ladechat.keepalive.client import servers

        if servers(_runtime_root()):  # one of this model would save what it holds in memory again
            err.print("notice: a model kept loaded ('ladechat ps') keeps the costs it learned until 'ladechat stop'",
                      highlight=False, soft_wrap=True)
        return
    kept = cost_envelope.kept_costs(loaded)
    if kept is None:
        if as_json:
            print(json.dumps({"model": loaded.name, "measured": False, "sizes": []}, indent=2))
        err.print(f"no step costs kept for {escape(loaded.name)} on this machine yet: its first chat measures them",
                  highlight=False, soft_wrap=True)
        return
    rows = kept.summary()
    if as_json:
        print(json.dumps({"model": loaded.name, "measured": True, "sizes": rows}, indent=2))
    else:
        stdout_console().print(kept_costs_table(loaded.name, rows))


def _old_bench_form(args: list[str]) -> str | None:
    """What `ladechat bench` with a flag that became a subcommand is now ('ladechat bench --step-cost
    ...' is 'ladechat bench step-cost ...'); None for any other command line."""
    if args[:1] != ["bench"] or any(sub in args[1:2] for sub in BENCH_FLAGS.values()):
        return None
    for arg in args[1:]:
        flag = arg.split("=", 1)[0]
        if flag in BENCH_FLAGS:
            rest = " ".join(a for a in args[1:] if a != "--step-cost")
            return (f"'ladechat bench {flag}' is now a subcommand: "
                    f"ladechat bench {BENCH_FLAGS[flag]} {rest}".rstrip())
    return None


@app.command()
def ps() -> None:
    """The models kept loaded for the next commands (see --keep-alive): model, device, load options,
    memory, until when."""
    from ladechat.keepalive.client import servers, table

    entries = servers(_runtime_root())
    if not entries:
        stderr_console().print("no model is kept loaded")
        return
    for line in table(entries):
        terminal.write(line + "\n")


@app.command()
def stop(model: Annotated[Optional[str], typer.Argument(help="The model to unload, as 'ladechat ps' names it (default: the only one kept loaded).")] = None,
         every: Annotated[bool, typer.Option("--all", help="Unload every model kept loaded.")] = False) -> None:
    """Unload a model kept loaded (stop its local server); an answer it is giving ends."""
    from ladechat.keepalive.client import stop as stop_servers

    stopped = stop_servers(_runtime_root(), model, every)
    err = stderr_console()
    if not stopped:
        err.print("no model is kept loaded")
    for entry in stopped:
        err.print(f"unloaded {escape(entry.model)} (pid {entry.record.get('pid') or (entry.info or {}).get('pid')})",
                  highlight=False)


store_app = typer.Typer(help="The stores of past answers that lookahead drafts from (one per model).",
                        no_args_is_help=True, rich_markup_mode=None)
app.add_typer(store_app, name="store")


@store_app.command("list")
def store_list() -> None:
    """Each model's store: answers, tokens, size on disk, file."""
    from ladechat.engine.draft.store import list_stores
    from ladechat.paths import cache_root

    infos = list_stores(cache_root())
    if not infos:
        stderr_console().print("no stores yet (answers are stored as the chat, ask and serve give them)")
    for info in infos:
        terminal.write(f"{info.model}\t{info.answers} answers\t{info.tokens} tokens\t{info.bytes / 1e6:.2f} MB\t{info.path}\n")


@store_app.command("clear")
def store_clear(model: Annotated[Optional[str], typer.Option("--model", "-m", help="Only this model's store (its name as 'ladechat store list' shows it).")] = None) -> None:
    """Delete the stores of past answers (every model's, or one)."""
    from ladechat.engine.draft.store import clear_stores, list_stores
    from ladechat.paths import cache_root

    if model is not None and model not in {info.model for info in list_stores(cache_root())}:
        raise Fail(f"no store for model {model!r} (see: ladechat store list)")
    gone = clear_stores(cache_root(), model)
    stderr_console().print(f"deleted {len(gone)} store{'s' if len(gone) != 1 else ''} "
                           f"({sum(i.answers for i in gone)} answers)")


def main(argv: list[str] | None = None) -> None:
    """The `ladechat` command (argv: its arguments, default sys.argv[1:]). Bad input of any kind
    (a flag, a value, a file, a model) is one line on stderr, never a traceback: exit status 1,
    or 2 for a flag that does not parse; 130 after Ctrl-C."""
    # Every error typer meets parsing the command line derives from its click's ClickException (a
    # vendored copy in recent typer, click itself in older ones): found from its public BadParameter.
    parse_error = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")
    args = sys.argv[1:] if argv is None else argv
    try:
        moved = _old_bench_form(args)
        if moved is not None:
            raise Fail(moved)
        code = app(args=args, prog_name="ladechat", standalone_mode=False)
    except UserError as exc:
        _fail(str(exc), 1)
    except parse_error as exc:  # e.g. --top-k abc, an unknown option
        _fail(exc.format_message(), exc.exit_code)
    except typer.Abort:
        sys.stderr.write("ladechat: interrupted\n")
        sys.exit(130)
    sys.exit(code or 0)


def _fail(message: str, status: int):
    # plain write: one line, never wrapped (messages from libraries may span lines)
    sys.stderr.write("ladechat: error: " + terminal.visible(" ".join(message.split())) + "\n")
    sys.exit(status)
