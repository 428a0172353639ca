"""Where ladechat keeps its files, by the XDG base directories: the cache folder (GGUF files'
configs and kernel layouts, the stores of past answers, measured step costs, mask-probe verdicts, layers offloaded to disk)
and the state folder (the chat's input history). Keep-alive's runtime folder falls back to the
cache folder (keepalive/runtime.py)."""

from __future__ import annotations

import os
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
