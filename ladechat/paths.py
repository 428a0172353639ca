"""Where ladechat keeps its files, by the XDG base directories: the cache folder (GGUF files'
configs and kernel layouts, the stores of past answers, measured step costs, mask-probe verdicts, layers offloaded to disk)
and the state folder (the chat's input history). Keep-alive's runtime folder falls back to the
cache folder (keepalive/runtime.py). And how a user's file is read whole (read_bounded): only a
regular file (a pipe or a device is never read, it may have no end), of at most a given size,
judged on the file it opened (no check-then-open race); each caller words the refusal its own way."""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import stat
from collections.abc import Mapping
from pathlib import Path


def cache_root(environ: Mapping[str, str] = os.environ) -> Path:
    """$XDG_CACHE_HOME/ladechat, else ~/.cache/ladechat."""
    return _base(environ, "XDG_CACHE_HOME", ".cache") / "ladechat"


def state_root(environ: Mapping[str, str] = os.environ) -> Path:
    """$XDG_STATE_HOME/ladechat, else ~/.local/state/ladechat."""
    return _base(environ, "XDG_STATE_HOME", os.path.join(".local", "state")) / "ladechat"


def _base(environ: Mapping[str, str], variable: str, default: str) -> Path:
    return Path(environ.get(variable) or os.path.join(os.path.expanduser("~"), default))


# -- a user's file, read whole ------------------------------------------------------------------
class Unreadable(Exception):
    """Why a file was not read: `kind` is "missing", "folder", "special" (a pipe, a device),
    "too large", "denied" or "error"; `detail`: the system's words, for "denied" and "error"."""

    def __init__(self, kind: str, detail: str = "") -> None:
        super().__init__(kind, detail)
        self.kind, self.detail = kind, detail


def read_bounded(path: Path | str, limit: int) -> bytes:
    """The bytes of the regular file at `path`, at most `limit` of them; Unreadable otherwise."""
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO opens at once, and is refused below
    except FileNotFoundError:
        raise Unreadable("missing") from None
    except PermissionError as exc:
        raise Unreadable("denied", exc.strerror or str(exc)) from None
    except OSError as exc:
        raise Unreadable("error", exc.strerror or str(exc)) from None
    info = os.fstat(descriptor)
    if not stat.S_ISREG(info.st_mode):
        os.close(descriptor)
        raise Unreadable("folder" if stat.S_ISDIR(info.st_mode) else "special")
    with os.fdopen(descriptor, "rb") as file:
        if info.st_size > limit:
            raise Unreadable("too large")
        try:
            data = file.read(limit + 1)
        except OSError as exc:
            raise Unreadable("error", exc.strerror or str(exc)) from None
    if len(data) > limit:
        raise Unreadable("too large")
    return data


# -- our own code's identity, for cache keys ---------------------------------------------------
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
