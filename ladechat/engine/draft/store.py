"""The persistent store of what the model has said: its past answers, one store per model.

Models repeat themselves across conversations: the same openings, code scaffolding, list
formats, closing lines. Every finished answer is added to a SuffixIndex (suffix.py) that drafts
from the longest match of the current text (SuffixDecoding, Oliaro et al., NeurIPS 2025; llama.cpp's
dynamic n-gram cache). The store only proposes; verification decides, so it never changes what is
generated, only how fast.

On disk: an append-only file of int32 token ids, each answer followed by SEP, plus a small JSON
file naming the model, under the cache folder. Appends are one write each, so two chats on the
same model both keep their answers. Size is capped (MAX_TOKENS): the oldest answers are dropped
when the store grows past it, and the file is rewritten when it holds twice that.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ladechat.engine.draft.suffix import SEP, SuffixIndex
from ladechat.errors import UserError

MAX_TOKENS = 1 << 18  # ~1000 answers of 256 tokens; 1 MB on disk, ~8 MB of index in memory


class StoreError(UserError, ValueError):
    """The store folder cannot be read or written; the message is one line for the user."""


def store_dir(cache_root: Path) -> Path:
    return cache_root / "store"


def store_path(cache_root: Path, model_name: str) -> Path:
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", model_name).strip("-")[-48:] or "model"
    return store_dir(cache_root) / f"{slug}-{hashlib.sha256(model_name.encode()).hexdigest()[:12]}.tokens"


class AnswerStore:
    """Past answers of one model. path=None: in memory only (the bench, tests)."""

    def __init__(self, path: Path | None = None, vocab_size: int | None = None, max_tokens: int = MAX_TOKENS) -> None:
        self.path = path
        self.vocab_size = vocab_size
        self.max_tokens = max_tokens
        self.index = SuffixIndex()
        self.answers = 0

    @classmethod
    def open(cls, path: Path, model_name: str, vocab_size: int, max_tokens: int = MAX_TOKENS) -> AnswerStore:
        """Load the store at `path` (missing: empty). Token ids outside the vocabulary (the file
        belongs to another tokenizer, or was damaged) and a last answer cut short are dropped."""
        store = cls(path, vocab_size, max_tokens)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            meta = path.with_suffix(".json")
            if not meta.exists():
                meta.write_text(json.dumps({"model": model_name, "vocab_size": vocab_size}) + "\n")
            raw = path.read_bytes() if path.exists() else b""
        except OSError as exc:
            raise StoreError(f"cannot use the answer store {path}: {exc.strerror or exc}") from None
        tokens = np.frombuffer(raw[: len(raw) // 4 * 4], dtype=np.int32)
        ends = np.flatnonzero(tokens == SEP)
        tokens = tokens[: ends[-1] + 1] if len(ends) else tokens[:0]
        if len(tokens) and ((tokens < SEP) | (tokens >= vocab_size)).any():
            tokens = tokens[:0]  # not this tokenizer's ids: start over rather than draft junk
        store._take(tokens)
        if len(raw) > 8 * max_tokens:  # twice the cap on disk: rewrite with what is kept
            store._rewrite()
        return store

    def _take(self, tokens: np.ndarray) -> None:
        self.index.extend(tokens)
        self.answers += int((tokens == SEP).sum())
        self._evict()

    def _evict(self) -> None:
        if len(self.index) <= self.max_tokens:
            return
        text = self.index.text[: len(self.index)]
        seps = np.flatnonzero(text == SEP)
        # drop the oldest answers down to 3/4 of the cap, so eviction is rare
        first_kept = np.searchsorted(seps, len(text) - self.max_tokens * 3 // 4)
        cut = int(seps[first_kept - 1]) + 1 if first_kept > 0 else 0
        if first_kept >= len(seps):  # one answer longer than the cap: keep nothing
            cut = len(text)
        self.answers -= int((text[:cut] == SEP).sum())
        self.index.drop_front(cut)

    def add(self, answer: list[int]) -> None:
        """Remember one answer (in memory, and appended to the file)."""
        if not answer:
            return
        record = np.asarray([*answer, SEP], dtype=np.int32)
        self._take(record)
        if self.path is not None:
            try:
                with open(self.path, "ab") as f:
                    f.write(record.tobytes())
            except OSError:
                self.path = None  # a full or read-only disk: keep going in memory

    def _rewrite(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        try:
            tmp.write_bytes(self.index.text[: len(self.index)].tobytes())
            os.replace(tmp, self.path)
        except OSError:
            pass  # the file stays longer than it needs to; it is read capped anyway

    def matches(self, tail: list[int], length: int, limit: int) -> list[tuple[tuple[int, ...], int]]:
        return self.index.matches(tail, length, limit)

    def __len__(self) -> int:
        return len(self.index)


@dataclass(frozen=True)
class StoreInfo:
    path: Path
    model: str
    answers: int
    tokens: int
    bytes: int


def list_stores(cache_root: Path) -> list[StoreInfo]:
    out = []
    for path in sorted(store_dir(cache_root).glob("*.tokens")):
        try:
            model = json.loads(path.with_suffix(".json").read_text()).get("model", "?")
        except (OSError, ValueError, AttributeError):
            model = "?"
        tokens = np.fromfile(path, dtype=np.int32) if path.stat().st_size else np.empty(0, np.int32)
        out.append(StoreInfo(path, str(model), int((tokens == SEP).sum()), int((tokens != SEP).sum()),
                             path.stat().st_size))
    return out


def clear_stores(cache_root: Path, model: str | None = None) -> list[StoreInfo]:
    """Delete every store, or the one of `model` (a name as `list_stores` shows it). Returns what
    was deleted."""
    gone = []
    for info in list_stores(cache_root):
        if model is None or info.model == model:
            for path in (info.path, info.path.with_suffix(".json")):
                path.unlink(missing_ok=True)
            gone.append(info)
    return gone
