"""The one place the front ends get their Bot (the chat, `ask`, `serve`, the keep-alive server, `bench
serving`'s server): open_bot(spec) answers through a server at a URL, a local server that keeps the
model loaded, or a model loaded in this process (open_here), as the spec (backends/spec.py, checked
when the flags built it) says; as mlx-lm's `load()` serves its generate, chat and server alike. The
bench loads through load_model and settings_for, as open_here does.

Nothing here prints: progress(message) is the caller's context manager for a slow phase."""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

from ladechat.backends.spec import Spec

Progress = Callable[[str], AbstractContextManager]


def run_here(fn):
    return fn()


def quiet_libraries() -> None:
    """transformers' own progress bars and advisory warnings would interleave with our output."""
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def open_bot(spec: Spec, progress: Progress, on_model_thread=run_here, again: Progress | None = None):
    """The Bot that answers as `spec` says: the server at spec.api, the local server that keeps
    the model loaded for spec.keep_alive (found or started, progress(message) meanwhile; `again`,
    default progress, while a later answer finds or starts it again), or the model loaded here
    (open_here; on_model_thread as there)."""
    if spec.api is not None:
        from ladechat.backends.remote import Endpoint, RemoteBot

        values, chosen = spec.sent()
        return RemoteBot(Endpoint.of(spec.api, spec.api_key), spec.load.model, values, chosen)
    spec = from_hub(spec, progress)
    if spec.keep_alive != 0:
        return warm_bot(spec, progress, again=again)
    return open_here(spec, progress, on_model_thread)[1]


def from_hub(spec: Spec, progress: Progress) -> Spec:
    """spec with a hub GGUF's name (hf.co/ORG/REPO:QUANT) as its file in the cache, downloaded here
    first where it is not (its sizes in the phase's line): a warm server, started detached, never
    downloads, so Ctrl-C stops a download and the progress shows where the command runs."""
    from ladechat.engine.load import hub

    model = spec.load.model
    ref = hub.gguf_ref(model) if model is not None and not os.path.exists(os.path.expanduser(model)) else None
    if ref is None:
        return spec
    return spec.with_model(str(hub.fetch_shown(*ref, progress)))


def warm_bot(spec: Spec, progress: Progress, start: bool = True, again: Progress | None = None):
    """A WarmBot on the local server that keeps spec's model loaded (keepalive/): the settings chosen,
    the store and the template travel with each request. start: find or start the server (or wait
    for the command starting it), progress(message) meanwhile; else only one that is up already
    (None if none is). again (default progress): shown while a later answer finds or starts the
    server again (expired, stopped): the chat's spinner, not the progress of its first load."""
    from ladechat.keepalive.client import WarmBot, ensure, find
    from ladechat.keepalive.runtime import ServerKey, runtime_root

    values, chosen = spec.sent()
    values.update(store=spec.settings["store"], template=spec.settings["template"])
    server = ServerKey.of(spec.load_options(), os.environ)
    root = runtime_root(os.environ)
    warm = ensure(server, spec.keep_alive, root, progress) if start else find(server, root)
    return None if warm is None else WarmBot(warm, values, chosen | {"store", "template"}, spec.keep_alive,
                                             again or progress)


def load_model(load_spec, progress: Progress | None, compile: bool = False):
    """The model (engine/load/loading.LoadedModel) of a LoadSpec, progress(message) shown during slow
    phases; its notices are the caller's. compile: the steps will be compiled, which takes the
    model's own Linear modules (no packing, no blocks)."""
    from ladechat.engine import thread_probe
    from ladechat.engine.load.loading import load

    return load(load_spec.for_steps(compile), progress, probe=thread_probe.cached_verdict)


def settings_for(given: dict, loaded=None, default_temperature: float = 0.0, compile: bool = False):
    """Settings (ladechat.settings) from the settings given. What is not given takes the device's
    defaults (on a GPU, W/N/G from the loaded model's measured step-cost curve; with compile the
    paper's W = G = 15, N = 5 without measuring: that curve is of eager exact-size steps, and the
    compiled full step was measured ahead of plain decoding and of smaller steps) and
    default_temperature. loaded=None: check the values before loading. ConfigError or TemplateError
    (one line) for a bad value."""
    from ladechat.engine.defaults import default_lookahead
    from ladechat.settings import Settings
    from ladechat.templates import resolve

    device_type = loaded.device.type if loaded is not None else "cpu"
    curve = None
    if device_type == "cuda" and not compile:
        from ladechat.engine import cost_envelope  # the step's modules: not before a prompt is shown

        curve = cost_envelope.measured_curve(loaded)
    base = default_lookahead(device_type, curve)
    settings = Settings.for_lookahead(base, temperature=default_temperature).updated(given)
    resolve(loaded.tokenizer if loaded is not None else None, settings.template)
    return settings


def bot_for(loaded, settings, compile: bool, progress: Progress, on_model_thread=run_here):
    """The Bot of a loaded model. on_model_thread(fn): runs fn on the thread that will answer (a
    server's model thread), where compiled steps are warmed up; by default this thread answers."""
    from ladechat.backends.local import Bot
    from ladechat.engine import cost_envelope
    from ladechat.engine.load.progress import titled
    from ladechat.paths import cache_root

    if not compile and not cost_envelope.costs_measured(loaded):  # the first use on this machine (or of this version)
        title = "measuring what a step costs on this machine"
        with progress(f"{title} (one time: seconds)") as update:
            cost_envelope.cost_model(loaded, titled(update, f"{title} (one time)"))
    bot = Bot(loaded, settings, compile=compile, store_root=cache_root())
    if compile:
        with progress("compiling the decoding steps (once per W/N/G)"):
            on_model_thread(bot.warm_up)
    return bot


def open_here(spec: Spec, progress: Progress, on_model_thread=run_here):
    """(settings, Bot) of the model loaded in this process: W/N/G for its device, the model's own
    temperature when it samples. on_model_thread(fn): runs fn on the thread that will answer (a
    server's model thread), where compiled steps are warmed up. The load's notices are the bot's first."""
    quiet_libraries()
    compile = compiles(spec)
    loaded = load_model(spec.load, progress, compile)
    settings, bot = compiled_or_not(loaded, spec.given, compile, spec.compile is None, progress,
                                    model_temperature(loaded), on_model_thread)
    bot.notices[:0] = loaded.notices
    return settings, bot


def compiled_or_not(loaded, given: dict, compile: bool, by_default: bool, progress: Progress,
                    default_temperature: float = 0.0, on_model_thread=run_here):
    """(settings, Bot). A compile the user did not ask for (by_default) that fails leaves the
    steps uncompiled, with a notice saying why: e.g. a model with sliding-window layers, which
    the fixed-shape cache does not hold, or W/N/G whose full step is over its row limit."""
    settings = settings_for(given, loaded, default_temperature, compile=compile)
    try:
        return settings, bot_for(loaded, settings, compile, progress, on_model_thread)
    except Exception as exc:  # torch.compile's failures have no common type; the uncompiled steps are the tested path
        if not (compile and by_default):
            raise
        why = next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
    on_model_thread(lambda: _drop_compiled(loaded))  # where the graphs were made
    settings = settings_for(given, loaded, default_temperature)
    bot = bot_for(loaded, settings, False, progress)
    bot.notices.append(f"the decoding steps run uncompiled, not compiled: {why} (--no-compile skips the try)")
    return settings, bot


def _drop_compiled(loaded) -> None:
    """What a failed compile left: the model's compiled forward and torch's graphs, and the GPU
    memory the abandoned fixed-shape cache held, so the uncompiled steps start with all of it."""
    import gc

    import torch

    from ladechat.engine.runner import drop_compiled_forward

    drop_compiled_forward(loaded.model)
    if loaded.device.type == "cuda":
        from ladechat.engine.runner import own_cudagraph_state

        own_cudagraph_state()  # torch's reset looks for this thread's CUDA-graph bookkeeping
    torch._dynamo.reset()
    gc.collect()
    if loaded.device.type == "cuda":
        torch.cuda.empty_cache()


def model_temperature(loaded) -> float:
    """The chat follows the model's generation config when it asks for sampling."""
    config = loaded.model.generation_config
    if getattr(config, "do_sample", False) and getattr(config, "temperature", None):
        return float(config.temperature)
    return 0.0


def compiles(spec: Spec) -> bool:
    """--compile/--no-compile as given; neither: the device's default (engine/defaults.py), without
    importing torch where its build has no CUDA (a CPU's chat shows its prompt at once)."""
    if spec.compile is not None:
        return spec.compile
    from ladechat.engine.defaults import compiles_by_default

    load = spec.load
    if load.device == "cpu" or (load.device == "auto" and not torch_has_cuda()):
        return False
    from ladechat.engine.load.placement import resolve_device
    from ladechat.engine.load.spec import LoadError

    try:
        kind = resolve_device(load.device).type
    except LoadError:  # the load says why, in its own words
        return False
    import torch

    if torch.version.hip is not None:  # AMD's GPUs answer as cuda; compiled steps were measured on NVIDIA's
        return False
    return compiles_by_default(kind, load.load_in_4bit or load.load_in_8bit or bool(load.quantize),
                               load.device_map is not None, load.weights)


def torch_has_cuda() -> bool:
    """Whether the installed torch is a CUDA build, read from its version.py (a CPU build says
    `cuda ... = None`) rather than by importing it (slow); unsure: True (the caller asks torch)."""
    import importlib.util

    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return False
    try:
        text = (Path(next(iter(spec.submodule_search_locations))) / "version.py").read_text()
    except OSError:
        return True
    return re.search(r"^cuda\b[^=\n]*=\s*None\s*$", text, re.MULTILINE) is None
