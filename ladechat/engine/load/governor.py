"""The steps' thread governor, allowed only the thread counts whose steps give the full count's bits."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path

from ladechat.engine.load import readers
from ladechat.engine.load.gguf import quantized
from ladechat.engine.threads import CpuThreads
from ladechat.paths import cache_root


def governed(threads: CpuThreads | None, model, name: str, source: str, gguf_file: Path | None, progress,
              probe: Callable | None) -> CpuThreads | None:
    """The thread governor, allowed the counts whose steps give the full count's bits on this CPU
    (thread_probe.py), or None where only the full count does: a lookahead answer must equal plain
    decoding's whatever the machine's load did meanwhile. MKL's dense fp32 products split their sums
    by the thread count by design, so a model with dense Linear weights is not probed."""
    if probe is None or threads is None or threads.ceiling == 1 or "dense" in quantized.weight_layout(model):
        return None
    folder = Path(source) if Path(source).is_dir() else None
    what = None
    if folder is not None:  # a model whose files can be named: its verdict is kept
        files = readers.model_files(folder)
        origin = (str(gguf_file.resolve()), gguf_file.stat().st_size) if gguf_file is not None else None
        what = [str(folder.resolve()), files, origin, quantized.weight_layout(model)]
    with progress("checking which thread counts give the same results") if progress else nullcontext():
        verdict = probe(model, what, threads.ceiling, cache_root() / "thread-probe" if what is not None else None)
    if len(verdict.counts) < 2:
        return None
    threads.restrict(verdict.counts, verdict.widest)
    return threads
