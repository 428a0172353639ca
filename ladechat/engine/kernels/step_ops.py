"""ladechat's kernels for a decoding step's small operations (step_ops.cpp): RMSNorm (norms.py),
the rotation of q and k (engine/models/llama.py) and the rows' top-k (runner.top_k), each one call
instead of several torch ops. On the CPU with a small model these ops' dispatch is a large
share of a step (measured: BENCHMARKS.md).

Model loading loads the library for any model on the CPU (compiled once per machine,
native.py). The rotation computes torch's very floats and the top-k torch's ranking (with equal
logits in index order, as argmax picks), so every path uses them, the dense one included; the
norms differ from transformers' in the last bits and replace them only on 4-bit weights
(norms.py). Where the library cannot be built, the torch ops serve, a little slower (the top-k
then orders exactly equal logits as torch.topk does).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

from ladechat.engine.kernels import native

SOURCE = Path(__file__).with_name("step_ops.cpp")


def load(kernels: Path, progress: Callable[[str], AbstractContextManager] | None = None,
         compiler: str = native.COMPILER) -> str | None:
    """Load the kernels (compiled into `kernels` if not yet): None, or why they cannot run (one line)."""
    return native.why_not_loaded(SOURCE, kernels, compiler, progress)


def loaded() -> bool:
    """Whether this process has the kernels (model loading loaded them)."""
    return native.loaded(SOURCE)
