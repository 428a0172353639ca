"""GGUF files from the Hugging Face hub, named as users name them: `hf.co/ORG/REPO[:QUANT]` (also
`huggingface.co/...`) or `ORG/REPO:QUANT`, QUANT Q4_K_M when none is named (as ollama and
llama.cpp's -hf take them). The repo's file of that quantization is found from its file list
(huggingface_hub's HfApi: the hub's address, HF_ENDPOINT, and token), downloaded into ladechat's
cache with a progress bar, checked against the sha256 the hub lists for it, and run as a local
GGUF. The download is ladechat's own, not hf_hub_download: that one writes each try to a file of
its own and deletes it when the try fails, so a download cut by Ctrl-C or a dropped connection
starts over, where a model is gigabytes; here the part downloaded is kept (`.partial`) and the
next try asks for the rest (an HTTP range), hashing as it goes. A
file in parts (`-00001-of-0000N.gguf`) is joined into one GGUF in ladechat's cache (llama.cpp
reads the parts as one model; ladechat's reader reads one file). Offline (HF_HUB_OFFLINE=1, or no
network) a model in the cache runs; one that is not is one line."""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

from ladechat.errors import ModelNotFound, UserError
from ladechat.paths import cache_root

DEFAULT_QUANT = "Q4_K_M"
HOSTS = ("hf.co/", "huggingface.co/", "https://hf.co/", "https://huggingface.co/")
REF = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?::(?P<quant>[\w.-]+))?$")
PART = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$")
# A quantization as GGUF file names spell it: Q4_K_M, IQ4_XS, Q8_0, F16, BF16, ...
QUANT_NAME = re.compile(r"(?<![A-Za-z0-9])((?:I?Q\d+(?:_[A-Z0-9]+)*)|F16|BF16|F32)(?![A-Za-z0-9])", re.IGNORECASE)
HASH_CHUNK = 1 << 24


class HubError(UserError):
    """A hub model that cannot be had (no such repo or quantization, gated, offline, a bad download)."""


@dataclass(frozen=True)
class HubFile:
    path: str  # in the repo
    size: int
    sha256: str | None


def gguf_ref(model: str) -> tuple[str, str] | None:
    """(repo, quantization) where `model` names a hub GGUF, else None: hf.co/ORG/REPO[:QUANT] or
    ORG/REPO:QUANT (ORG/REPO alone is a transformers checkpoint, read by transformers)."""
    host = next((h for h in HOSTS if model.startswith(h)), None)
    match = REF.match(model[len(host):] if host else model)
    if match is None or (host is None and match["quant"] is None):
        return None
    return match["repo"], (match["quant"] or DEFAULT_QUANT)


def quant_of(name: str) -> str | None:
    """The quantization a GGUF file's name (or its folder's) says, upper case."""
    found = QUANT_NAME.findall(PART.sub(".gguf", name))
    return found[-1].upper() if found else None


def choose(files: list[HubFile], repo: str, quant: str) -> list[HubFile]:
    """The file of `quant` (or its parts, in order). HubError listing the quantizations the repo
    has where it has none of that one."""
    ggufs = [f for f in files if f.path.endswith(".gguf") and "mmproj" not in f.path.lower()]
    mine = [f for f in ggufs if quant_of(f.path) == quant.upper()]
    if not mine:
        have = sorted({q for f in ggufs if (q := quant_of(f.path))})
        raise HubError(f"{repo} has no {quant} GGUF" + (f" (it has: {', '.join(have)})" if have else " (it has no GGUF files)"))
    whole = [f for f in mine if not PART.search(f.path)]
    if whole:
        return [min(whole, key=lambda f: len(f.path))]
    parts = sorted(mine, key=lambda f: f.path)
    counts = {int(PART.search(f.path).group(2)) for f in parts}
    if len(counts) != 1 or len(parts) != counts.pop():
        raise HubError(f"{repo}'s {quant} GGUF is in parts that do not make a whole: {', '.join(f.path for f in parts)}")
    return parts


def fetch(repo: str, quant: str) -> Path:
    """The local GGUF file of repo:quant, downloaded and checked first where it is not in the cache."""
    from huggingface_hub import constants

    files, why = None, "offline: HF_HUB_OFFLINE is set"
    if not constants.HF_HUB_OFFLINE:
        try:
            files = listing(repo)
        except HubError:
            raise
        except Exception as exc:  # noqa: BLE001 -- no network, a hub that is down: the cache may still hold it
            if not _is_network_error(exc):
                raise
            why = f"the hub cannot be reached: {_one_line(exc)}"
    if files is None:
        return _cached(repo, quant, why)
    chosen = choose(files, repo, quant)
    paths = [download(repo, f) for f in chosen]
    return paths[0] if len(paths) == 1 else joined(paths)


def listing(repo: str) -> list[HubFile]:
    """The repo's files with their sizes and sha256 (HubError for a repo that is missing or gated)."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    try:
        entries = list(HfApi().list_repo_tree(repo, recursive=True))
    except GatedRepoError:
        raise HubError(f"{repo} is gated: accept its terms on huggingface.co, then log in "
                       "(`hf auth login`, or HF_TOKEN)") from None
    except RepositoryNotFoundError:
        raise HubError(f"no model {repo} on the hub (or it is private: log in with `hf auth login`, or HF_TOKEN)") from None
    return [HubFile(e.path, e.size, e.lfs.sha256 if getattr(e, "lfs", None) else None)
            for e in entries if getattr(e, "size", None) is not None]


def hub_folder() -> Path:
    return cache_root() / "hub"


def local_path(repo: str, path: str) -> Path:
    return hub_folder() / repo.replace("/", "--") / path


def download(repo: str, file: HubFile) -> Path:
    """The file in ladechat's cache, downloaded where it is not (the rest of a `.partial` left by
    an earlier try), checked against the hub's sha256: a file that fails it is removed, never run."""
    dest = local_path(repo, file.path)
    if dest.is_file() and dest.stat().st_size == file.size:
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    partial = dest.with_name(dest.name + ".partial")
    digest = [hashlib.sha256()]
    have = partial.stat().st_size if partial.is_file() else 0
    if have > file.size:
        partial.unlink()
        have = 0
    if have:
        with open(partial, "rb") as fh:
            while chunk := fh.read(HASH_CHUNK):
                digest[0].update(chunk)
    try:
        _get(repo, file, partial, have, digest)
    except HubError:
        raise
    except Exception as exc:  # noqa: BLE001 -- the connection dropped: what came is kept for the next try
        if not _is_network_error(exc):
            raise
        raise HubError(f"downloading {repo}/{file.path} stopped ({_one_line(exc)}); run the command again to go "
                       "on where it stopped") from None
    if partial.stat().st_size != file.size or (file.sha256 and digest[0].hexdigest() != file.sha256):
        partial.unlink()
        raise HubError(f"{repo}/{file.path} does not match the hub's checksum (a corrupt download): removed; "
                       "run the command again to download it anew")
    partial.replace(dest)
    return dest


def _get(repo: str, file: HubFile, partial: Path, have: int, digest: list) -> None:
    """The bytes of `file` from `have` on, appended to `partial` and to digest[0] (a new one where
    the server sends the whole file again)."""
    from urllib.parse import quote

    import httpx
    from huggingface_hub import constants
    from huggingface_hub.utils import build_hf_headers
    from tqdm.auto import tqdm

    headers = build_hf_headers()
    if have:
        headers["Range"] = f"bytes={have}-"
    with httpx.Client(follow_redirects=True, timeout=httpx.Timeout(30.0, read=60.0)) as client, \
            client.stream("GET", f"{constants.ENDPOINT}/{repo}/resolve/main/{quote(file.path)}", headers=headers) as response:
        if response.status_code in (401, 403):
            raise HubError(f"{repo} is gated or private: accept its terms on huggingface.co, then log in "
                           "(`hf auth login`, or HF_TOKEN)")
        response.raise_for_status()
        if have and response.status_code != 206:  # a server that sends it all from the start
            have, digest[0] = 0, hashlib.sha256()
        with open(partial, "ab" if have else "wb") as out, tqdm(total=file.size, initial=have, unit="B", unit_scale=True,
                                                                desc=Path(file.path).name, disable=None) as bar:
            for chunk in response.iter_bytes(1 << 20):
                out.write(chunk)
                digest[0].update(chunk)
                bar.update(len(chunk))


def _cached(repo: str, quant: str, why: str) -> Path:
    """repo:quant from the cache alone (offline: `why`): HubError where it is not there."""
    folder = local_path(repo, "")
    files = [HubFile(str(p.relative_to(folder)), p.stat().st_size, None) for p in sorted(folder.rglob("*.gguf"))
             if p.is_file()] if folder.is_dir() else []
    try:
        chosen = choose(files, repo, quant)
    except HubError:
        raise HubError(f"{repo}:{quant} is not downloaded, and {why}") from None
    paths = [folder / f.path for f in chosen]
    return paths[0] if len(paths) == 1 else joined(paths)


@dataclass(frozen=True)
class Downloaded:
    name: str  # repo:quant, as --model takes it (with hf.co/ before it)
    paths: tuple[Path, ...]
    size: int  # bytes


def downloaded() -> list[Downloaded]:
    """The hub GGUFs in ladechat's cache, one per repo and quantization, by name."""
    found: dict[str, list[Path]] = {}
    for repo_folder in sorted(hub_folder().glob("*--*")) if hub_folder().is_dir() else []:
        repo = repo_folder.name.replace("--", "/", 1)
        for path in sorted(repo_folder.rglob("*.gguf")):
            if path.is_file() and "mmproj" not in path.name.lower() \
                    and (quant := quant_of(str(path.relative_to(repo_folder)))):
                found.setdefault(f"{repo}:{quant}", []).append(path)
    return [Downloaded(name, tuple(paths), sum(p.stat().st_size for p in paths)) for name, paths in found.items()]


def remove(repo: str, quant: str) -> list[Path]:
    """Delete repo:quant's files from the cache, a joined copy, and what their loads kept (config,
    tokenizer, kernel layouts: as large as the model); the paths removed. HubError where none are there."""
    import shutil

    from ladechat.engine.load.gguf.files import prepared_dir

    name = f"{repo}:{quant.upper()}"
    entry = next((d for d in downloaded() if d.name.lower() == name.lower()), None)
    if entry is None:
        raise HubError(f"{name} is not downloaded (see: ladechat models)")
    files = list(entry.paths) + list((cache_root() / "joined").glob(f"{PART.sub('', entry.paths[0].name)}-*.gguf"))
    kept = [folder for path in files if (folder := prepared_dir(path)).is_dir()]
    for path in files:
        path.unlink()
    for folder in kept:
        shutil.rmtree(folder, ignore_errors=True)
    return files + kept


def _is_network_error(exc: Exception) -> bool:
    """A failure of the connection or of the hub's side (after huggingface_hub's retries), not a bug."""
    import httpx

    return isinstance(exc, (httpx.HTTPError, OSError)) or type(exc).__module__.startswith("huggingface_hub")


def _one_line(exc: Exception) -> str:
    return " ".join(str(exc).split())[:200] or type(exc).__name__


def joined(parts: list[Path]) -> Path:
    """One GGUF of a file's parts (gguf-split's: each part a GGUF of some of the tensors, the first
    holding the metadata), written once into ladechat's cache beside the parts' names."""
    import numpy as np
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    first = parts[0].resolve()
    stat = first.stat()
    key = hashlib.sha256(f"{first}|{stat.st_size}|{stat.st_mtime_ns}|{len(parts)}".encode()).hexdigest()[:12]
    out = cache_root() / "joined" / f"{PART.sub('', parts[0].name)}-{key}.gguf"
    if out.is_file():
        return out
    readers = [GGUFReader(p) for p in parts]
    arch = readers[0].fields["general.architecture"]
    writer = GGUFWriter(None, bytes(arch.parts[arch.data[0]]).decode())
    for name, field in readers[0].fields.items():
        if name.startswith(("GGUF.", "split.")) or name == "general.architecture":
            continue
        kind = field.types[0]
        if kind == GGUFValueType.ARRAY:
            values = field.contents()
            writer.add_key_value(name, values, kind, sub_type=field.types[-1])
        else:
            writer.add_key_value(name, field.contents(), kind)
    for reader in readers:
        for tensor in reader.tensors:
            writer.add_tensor(tensor.name, np.asarray(tensor.data),
                              raw_dtype=tensor.tensor_type)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_suffix(".partial")
    writer.write_header_to_file(partial)
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    partial.replace(out)
    return out
