"""Whether weights fit in the memory this machine has, checked before they are read: the kernel's
OOM killer would otherwise end the process without a word."""

from __future__ import annotations

from pathlib import Path

from ladechat.engine.kernels import q4
from ladechat.engine.load.gguf import quantized
from ladechat.engine.load.spec import LoadError


def available_memory() -> int | None:
    """Bytes of memory the kernel says a new process can take without swapping (MemAvailable), None
    where it does not say."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_dense_fits(model, gguf_file: Path, index: dict, empty: set[str], available: int | None) -> None:
    """LoadError (one line) where the tensors still to be read dense, in the model's dtype (those
    without a kernel for their blocks here, e.g. an F16 file's, or a Q3_K_M file's Q3_K ones), would not fit in the
    memory available: the kernel's OOM killer would otherwise end the process without a word."""
    tensors = dict((*model.named_parameters(), *model.named_buffers()))
    needed = sum(tensors[name].numel() * tensors[name].element_size() for name in empty)
    if available is None or needed <= available:
        return
    kinds = sorted(_dense_kinds(model, index, empty))
    what = f"its {'/'.join(kinds)} tensors" if kinds else "its tensors"
    raise LoadError(f"not enough memory for {gguf_file.name}: {what} run dense here, "
                    f"{size_text(needed)} in {str(model.dtype).removeprefix('torch.')}, and {size_text(available)} is available")


def no_kernel_notices(model, gguf_file: Path, index: dict, empty: set[str]) -> tuple[str, ...]:
    """A notice naming the block types of the file's weights that no kernel here runs (IQ4_XS,
    Q3_K, ...; and every type of BLOCK_KINDS where ladechat's kernels do not run: no compiler, no
    AVX2) and so run dequantized into the model's dtype: slower and larger than the file. A Q8_0
    embedding that runs dense because its module scales its rows (Gemma) is not news."""
    ours = quantized.BLOCK_KINDS if q4.loaded() and q4.best_path() >= 1 else ()
    kinds = sorted(_dense_kinds(model, index, empty) - {*ours, "F32"})
    if not kinds:
        return ()
    dtype = str(model.dtype).removeprefix("torch.")
    return (f"{gguf_file.name}: its {'/'.join(kinds)} tensors run dequantized to {dtype} (no kernel for them here)",)


def _dense_kinds(model, index: dict, empty: set[str]) -> set[str]:
    """The GGUF block types of the weights (2-D tensors) among `empty`: those still to be read dense."""
    from gguf import GGMLQuantizationType

    tensors = dict((*model.named_parameters(), *model.named_buffers()))
    return {GGMLQuantizationType(where["type"]).name for name, where in index["tensors"].items()
            if name in empty and tensors[name].dim() >= 2}


def size_text(count: int) -> str:
    """Bytes for a person: GiB from one, else MiB."""
    return f"{count / 2**30:.1f} GiB" if count >= 2**30 else f"{count / 2**20:.0f} MiB"
