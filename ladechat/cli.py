"""Command line: `ladechat` (chat), `ladechat ask`, `ladechat bench`, `ladechat templates`."""

from __future__ import annotations

import json
import os
import sys
from contextlib import AbstractContextManager
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.markup import escape

from ladechat.errors import UserError

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
Dtype = Annotated[str, typer.Option("--dtype", help="auto, float32, bfloat16 or float16 (auto: bf16 on GPUs and CPUs with native bf16, else fp32).")]
Device = Annotated[str, typer.Option("--device", help="auto, cpu, cuda or cuda:N.")]
FourBit = Annotated[bool, typer.Option("--load-in-4bit", help="Quantize weights to 4 bits with bitsandbytes.")]
EightBit = Annotated[bool, typer.Option("--load-in-8bit", help="Quantize weights to 8 bits with bitsandbytes.")]
DeviceMap = Annotated[Optional[str], typer.Option("--device-map", help="accelerate device map, e.g. 'auto' to spread a large model over GPUs and CPU memory.")]
MaxMemory = Annotated[Optional[str], typer.Option("--max-memory", help="With --device-map: memory per device, e.g. '0=20GiB,cpu=64GiB'; what fits nowhere is offloaded to disk.")]
Attn = Annotated[str, typer.Option("--attn", help="Attention kernel: sdpa, eager or flash.")]
Template = Annotated[Optional[str], typer.Option("--template", help="Chat template to use instead of the model's own (see: ladechat templates).")]
System = Annotated[Optional[str], typer.Option("--system", "-s", help="System prompt.")]
Stop = Annotated[Optional[list[str]], typer.Option("--stop", help="Stop the answer after this text (repeatable).")]
Compile = Annotated[bool, typer.Option("--compile", help="Fixed-shape steps on a pre-allocated KV cache, compiled with torch.compile (CUDA graphs on a GPU); every lookahead step is a full one. Compiles at start.")]
Markdown = Annotated[bool, typer.Option("--markdown/--no-markdown", help="On a terminal, redraw a finished answer that has code blocks, lists or headings as rendered Markdown.")]
Debug = Annotated[bool, typer.Option("--debug", help="Show per-step acceptance and a per-turn statistics panel on stderr.")]


def stdout_console() -> Console:
    return Console(no_color=bool(os.environ.get("NO_COLOR")) or None, highlight=False)


def stderr_console() -> Console:
    return Console(stderr=True, no_color=bool(os.environ.get("NO_COLOR")) or None, highlight=False)


def _settings(flags: dict, loaded=None, default_temperature: float = 0.0):
    """Settings (ladechat.settings) from a command's parameters: those named like a setting and
    given (not None). What is not given takes the device's defaults (on a GPU, W/N/G from the loaded
    model's measured step-cost curve) and default_temperature. loaded=None: check the flags before
    loading. ConfigError or TemplateError (one line) for a bad value."""
    from ladechat.engine.defaults import default_lookahead
    from ladechat.settings import Settings, keys
    from ladechat.templates import resolve

    given = {name: value for name, value in flags.items() if name in keys() and value is not None}
    if given.get("stop") is not None:
        given["stop"] = [text for text in given["stop"] if text]
    device_type = loaded.device.type if loaded is not None else "cpu"
    base = default_lookahead(device_type, loaded.step_cost() if device_type == "cuda" else None)
    settings = Settings.for_lookahead(base, temperature=default_temperature).updated(given)
    resolve(loaded.tokenizer if loaded is not None else None, settings.template)
    return settings


def _load(model, dtype, device, attn, load_in_4bit, load_in_8bit, device_map, err: Console, max_memory=None):
    from ladechat.engine.loading import LoadSpec, load, parse_max_memory, resolve_device, resolve_dtype

    def progress(message: str) -> AbstractContextManager:
        return err.status(message, spinner="dots")

    spec = LoadSpec(model=model, dtype=dtype, device=device, attn=attn, load_in_4bit=load_in_4bit,
                    load_in_8bit=load_in_8bit, device_map=device_map,
                    max_memory=parse_max_memory(max_memory) if max_memory is not None else ())
    resolve_dtype(dtype, resolve_device(device))  # flag errors before any slow import
    loaded = load(spec, progress)
    for notice in loaded.notices:
        # soft_wrap: a notice stays one line in a pipe or a log (the terminal wraps it on screen)
        err.print(f"[yellow]notice:[/] {escape(notice)}", highlight=False, soft_wrap=True)
    return loaded


def _bot(loaded, settings, compile: bool, err: Console):
    from ladechat.bot import Bot

    bot = Bot(loaded, settings, compile=compile)
    if compile:
        with err.status("compiling the decoding steps (once per W/N/G)", spinner="dots"):
            bot.warm_up()
    return bot


def _quiet_libraries() -> None:
    # transformers' own progress bars and advisory warnings would interleave with our output.
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


@app.callback(invoke_without_command=True)
def chat(ctx: typer.Context, model: Model = None, lookahead: Lookahead = True, window: Window = None,
         ngram: Ngram = None, candidates: Cands = None, context_candidates: ContextCands = None,
         context_len: ContextLen = None, recycle: Recycle = None, max_new_tokens: MaxNew = 1024,
         temperature: Temperature = None, top_p: TopP = 1.0, top_k: TopK = 0, min_p: MinP = 0.0,
         repetition_penalty: RepPenalty = 1.0, seed: Seed = None, dtype: Dtype = "auto", device: Device = "auto",
         load_in_4bit: FourBit = False, load_in_8bit: EightBit = False, device_map: DeviceMap = None,
         max_memory: MaxMemory = None, attn: Attn = "sdpa", template: Template = None, system: System = None, stop: Stop = None,
         compile: Compile = False, markdown: Markdown = True, debug: Debug = False) -> None:
    """Interactive multi-turn chat (the default command). Type /help inside for commands."""
    flags = dict(locals())  # the parameters named like a setting become Settings (see _settings)
    if ctx.invoked_subcommand is not None:
        return
    from ladechat.ui.chat import run_chat

    err = stderr_console()
    _settings(flags)  # every flag checked before the (slow) model load
    _quiet_libraries()
    loaded = _load(model, dtype, device, attn, load_in_4bit, load_in_8bit, device_map, err, max_memory)
    settings = _settings(flags, loaded, default_temperature=_model_temperature(loaded))
    bot = _bot(loaded, settings, compile, err)
    run_chat(bot, system=system, debug=debug, markdown=markdown, out=stdout_console(), err=err)


def _model_temperature(loaded) -> float:
    """The chat follows the model's generation config when it asks for sampling."""
    config = loaded.model.generation_config
    if getattr(config, "do_sample", False) and getattr(config, "temperature", None):
        return float(config.temperature)
    return 0.0


@app.command()
def ask(prompt: Annotated[Optional[str], typer.Argument(help="The question; '-' or a pipe reads it from stdin.")] = None,
        model: Model = None, lookahead: Lookahead = True, window: Window = None, ngram: Ngram = None,
        candidates: Cands = None, context_candidates: ContextCands = None, context_len: ContextLen = None,
        recycle: Recycle = None, max_new_tokens: MaxNew = 512, temperature: Temperature = None,
        top_p: TopP = 1.0, top_k: TopK = 0, min_p: MinP = 0.0, repetition_penalty: RepPenalty = 1.0,
        seed: Seed = None, dtype: Dtype = "auto", device: Device = "auto", load_in_4bit: FourBit = False,
        load_in_8bit: EightBit = False, device_map: DeviceMap = None, max_memory: MaxMemory = None,
        attn: Attn = "sdpa",
        template: Template = None, system: System = None, stop: Stop = None, compile: Compile = False,
        markdown: Markdown = True, debug: Debug = False, as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object (text, token_ids, stats) instead of streaming.")] = False) -> None:
    """One-shot answer to PROMPT, streamed to stdout (greedy unless --temperature is given)."""
    flags = dict(locals())  # the parameters named like a setting become Settings (see _settings)
    from ladechat.bot import Notice
    from ladechat.conversation import Conversation
    from ladechat.engine.decode import OutOfMemory
    from ladechat.engine.events import Done
    from ladechat.ui.stream import StreamPrinter, debug_panel, footer

    err = stderr_console()
    text = _read_prompt(prompt)
    _settings(flags)  # every flag checked before the (slow) model load
    _quiet_libraries()
    loaded = _load(model, dtype, device, attn, load_in_4bit, load_in_8bit, device_map, err, max_memory)
    settings = _settings(flags, loaded)
    bot = _bot(loaded, settings, compile, err)
    conversation = Conversation(system=system, messages=[{"role": "user", "content": text}])
    out = stdout_console()
    printer = StreamPrinter(loaded.tokenizer, out, err, debug=debug, markdown=markdown)
    done = None
    try:
        for event in bot.reply(conversation):
            if isinstance(event, Done):
                done = event
            elif not as_json or isinstance(event, Notice):
                printer.handle(event)
    except OutOfMemory as exc:
        if printer.text:
            out.print()
        raise Fail(f"{exc}; try a shorter prompt, a smaller --max-new-tokens, -W or -G, or --load-in-4bit") from None
    except KeyboardInterrupt:
        err.print("\n[yellow]interrupted[/]")
        raise typer.Exit(130) from None
    if done is None:
        raise Fail("generation ended without a result")
    stats = done.stats
    if as_json:
        stats_dict = stats.as_dict()
        record = {"text": loaded.tokenizer.decode(list(done.text_tokens), skip_special_tokens=True),
                  "token_ids": list(done.text_tokens), "model": loaded.name, "stats": stats_dict}
        sys.stdout.write(json.dumps(record, ensure_ascii=False) + "\n")
    else:
        printer.finish(complete=stats.finish_reason != "interrupted")
        if debug:
            err.print(debug_panel(stats))
        err.print(f"[dim]{footer(stats)}[/]", highlight=False)
    if stats.finish_reason == "interrupted":
        raise typer.Exit(130)


def _read_prompt(prompt: str | None) -> str:
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
        raise Fail("empty prompt")
    return prompt.strip("\n")


@app.command()
def templates() -> None:
    """List the chat templates shipped with ladechat (for --template)."""
    from ladechat import templates as shipped

    for name in shipped.names():
        print(name)


@app.command()
def bench(dataset: Annotated[list[str], typer.Option("--dataset", "-d", help="Prompt set: mtbench, humaneval, gsm8k (from ../shared/data) or a JSONL path; repeatable.")] = ["mtbench"],
          methods: Annotated[str, typer.Option("--methods", help="Comma-separated: hf (always run, the reference), hf-lookup-3, hf-lookup-5, hf-lookup (10 tokens), plain, lookahead, lookahead-full.")] = "hf,hf-lookup-3,hf-lookup-5,hf-lookup,plain,lookahead",
          single_turn: Annotated[bool, typer.Option("--single-turn", help="Only the first turn of each item.")] = False,
          limit: Annotated[Optional[int], typer.Option("--limit", help="Items per dataset (default: all).")] = None,
          model: Model = None, window: Window = None, ngram: Ngram = None, candidates: Cands = None,
          context_candidates: ContextCands = None, context_len: ContextLen = None, recycle: Recycle = None,
          max_new_tokens: MaxNew = 256, temperature: Temperature = None, top_p: TopP = 1.0, top_k: TopK = 0,
          seed: Seed = 0, dtype: Dtype = "auto", device: Device = "auto", attn: Attn = "sdpa",
          template: Template = None, compile: Compile = False,
          step_cost: Annotated[bool, typer.Option("--step-cost", help="Measure time per step against tokens fed (dynamic, static, --compile'd runners) instead of answering prompts.")] = False,
          shape: Annotated[Optional[str], typer.Option("--shape", help="With --step-cost: a randomly initialised Llama of this shape instead of --model: llama-2-7b, llama-3-8b, smollm2-135m, tiny.")] = None,
          sizes: Annotated[str, typer.Option("--sizes", help="With --step-cost: tokens fed per step, comma-separated (1 or multiples of 4).")] = "1,8,16,32,64,128,256",
          context: Annotated[int, typer.Option("--context", help="With --step-cost: tokens already in the KV cache.")] = 512,
          reps: Annotated[int, typer.Option("--reps", help="With --step-cost: timed steps per size (median).")] = 10,
          as_json: Annotated[bool, typer.Option("--json", help="Print the results as JSON.")] = False) -> None:
    """Compare HF generate, HF prompt lookup, ladechat plain and lookahead on real prompts, side by side."""
    flags = dict(locals())  # the parameters named like a setting become Settings (see _settings)
    from ladechat import bench as benchmark
    from ladechat.ui.report import bench_tables

    err = stderr_console()
    if step_cost:
        _step_cost(model, shape, sizes, context, reps, compile, dtype, device, attn, as_json, err)
        return
    method_list = [m.strip() for m in methods.split(",") if m.strip()]
    benchmark.check_methods(method_list)
    for name in dataset:
        benchmark.load_items(name, limit)  # a bad file fails now, not after loading the model
    if limit is not None and limit < 1:
        raise Fail(f"--limit must be >= 1, got {limit}")
    _settings(flags)  # every flag checked before the (slow) model load
    _quiet_libraries()
    loaded = _load(model, dtype, device, attn, False, False, None, err)
    settings = _settings(flags, loaded)
    results = benchmark.run(loaded, dataset, method_list, settings, limit, compile=compile, single_turn=single_turn,
                            progress=lambda name, i, n: err.print(f"[dim]{escape(name)}: {i}/{n}[/]", highlight=False))
    if as_json:
        print(json.dumps(results, indent=2))
    else:
        for table in bench_tables(results):
            stdout_console().print(table)


def _step_cost(model, shape, sizes, context, reps, compile, dtype, device, attn, as_json, err) -> None:
    from ladechat import step_bench
    from ladechat.engine.loading import resolve_device, resolve_dtype
    from ladechat.ui.report import step_cost_table

    size_list = step_bench.parse_sizes(sizes)
    if context < 1 or reps < 1:
        raise Fail(f"--context and --reps must be >= 1, got {context} and {reps}")
    if shape is not None and model is not None:
        raise Fail("give --model or --shape, not both")
    _quiet_libraries()
    if shape is not None:
        dev = resolve_device(device)
        with err.status(f"building a random {shape} model on {dev}", spinner="dots"):
            net, name = step_bench.random_model(shape, resolve_dtype(dtype, dev), dev), f"random {shape}"
    else:
        loaded = _load(model, dtype, device, attn, False, False, None, err)
        net, name = loaded.model, loaded.name
    with err.status("timing steps" + (" (compiling first)" if compile else ""), spinner="dots"):
        result = step_bench.run(net, name, size_list, context, reps, compile)
    if as_json:
        print(json.dumps(result, indent=2))
    else:
        stdout_console().print(step_cost_table(result))


def main(argv: list[str] | None = None) -> None:
    """The `ladechat` command (argv: its arguments, default sys.argv[1:]). Bad input of any kind
    (a flag, a value, a file, a model) is one line on stderr, never a traceback: exit status 1,
    or 2 for a flag that does not parse; 130 after Ctrl-C."""
    # Every error typer meets parsing the command line derives from its click's ClickException (a
    # vendored copy in recent typer, click itself in older ones): found from its public BadParameter.
    parse_error = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")
    try:
        code = app(args=argv, prog_name="ladechat", standalone_mode=False)
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
    sys.stderr.write("ladechat: error: " + " ".join(message.split()) + "\n")
    sys.exit(status)
