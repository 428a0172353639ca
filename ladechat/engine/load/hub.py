"""GGUF files from the Hugging Face hub, named as users name them: `hf.co/ORG/REPO[:QUANT]` (also
`huggingface.co/...`) or `ORG/REPO:QUANT`, QUANT Q4_K_M when none is named (as ollama and
llama.cpp's -hf take them). The repo's file of that quantization is found from its file list
(huggingface_hub's HfApi: the hub's address, HF_ENDPOINT, and token), downloaded into ladechat's
cache, checked against the sha256 the hub lists for it, and run as a local GGUF.

The download is ladechat's own, not hf_hub_download: that one writes each try to a file of its
own and deletes it when the try fails, so a download cut by Ctrl-C or a dropped connection starts
over, where a model is gigabytes; here the part downloaded is kept (`.partial`, with the sha256 it
is a part of) and the next try asks for the rest (an HTTP range), hashing as it goes. One process
downloads a file at a time (a lock beside it; another waits). A file in parts
(`-00001-of-0000N.gguf`) is joined into one GGUF beside them (llama.cpp reads the parts as one
model; ladechat's reader reads one file). Offline (HF_HUB_OFFLINE=1, or the hub cannot be
reached) a model in the cache runs; one that is not is one line. The hub's file list is not
trusted: a path that would leave the repo's folder, or holds control characters, is refused."""

from __future__ import annotations

import fcntl
import hashlib
import json
import re
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

from ladechat.engine.load.progress import Report, sized
from ladechat.errors import UserError
from ladechat.paths import cache_root

DEFAULT_QUANT = "Q4_K_M"
HOSTS = ("hf.co/", "huggingface.co/", "https://hf.co/", "https://huggingface.co/")
# the hub's own rule for a repo id: letters, digits, -, _ and . (no -- or .. inside, not at the ends)
NAME_PART = r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?"
REF = re.compile(rf"^(?P<repo>{NAME_PART}/{NAME_PART})(?::(?P<quant>[A-Za-z0-9_.-]+))?$")
PART = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$")
# A quantization as GGUF file names spell it: Q4_K_M, IQ4_XS, Q8_0, F16, BF16, ...
QUANT_NAME = re.compile(r"(?<![A-Za-z0-9])((?:I?Q\d+(?:_[A-Z0-9]+)*)|F16|BF16|F32)(?![A-Za-z0-9])", re.IGNORECASE)
SAFE_PATH = re.compile(r"^[\w.+-]+(?:/[\w.+-]+)*$")  # a repo file's path as the cache takes it
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
    if match is None or (host is None and match["quant"] is None) or "--" in match["repo"] or ".." in match["repo"]:
        return None
    return match["repo"], (match["quant"] or DEFAULT_QUANT)


def quant_of(name: str) -> str | None:
    """The quantization a GGUF file's name (or its folder's) says, upper case."""
    found = QUANT_NAME.findall(PART.sub(".gguf", name))
    return found[-1].upper() if found else None


def choose(files: list[HubFile], repo: str, quant: str) -> list[HubFile]:
    """The file of `quant` (or its parts, 1 to N of one file, in order). HubError listing the
    quantizations the repo has where it has none of that one."""
    ggufs = [f for f in files if f.path.endswith(".gguf") and "mmproj" not in f.path.lower()]
    mine = [f for f in ggufs if quant_of(f.path) == quant.upper()]
    if not mine:
        have = sorted({q for f in ggufs if (q := quant_of(f.path))})
        raise HubError(f"{repo} has no {quant} GGUF" + (f" (it has: {', '.join(have)})" if have else " (it has no GGUF files)"))
    whole = [f for f in mine if not PART.search(f.path)]
    if whole:
        return [min(whole, key=lambda f: (len(f.path), f.path))]
    sets: dict[str, list[HubFile]] = {}
    for f in mine:
        sets.setdefault(PART.sub("", f.path), []).append(f)
    for parts in sorted(sets.values(), key=lambda p: p[0].path):
        numbers = sorted((int(PART.search(f.path).group(1)), int(PART.search(f.path).group(2))) for f in parts)
        count = numbers[0][1]
        if [n for n, _ in numbers] == list(range(1, count + 1)) and all(c == count for _, c in numbers):
            return sorted(parts, key=lambda f: f.path)
    raise HubError(f"{repo}'s {quant} GGUF is in parts that do not make a whole: {', '.join(f.path for f in mine)}")


def fetch(repo: str, quant: str, report: Report | None = None, refresh: bool = False) -> Path:
    """The local GGUF file of repo:quant: the one in the cache (unless `refresh`: asked of the hub
    again), else downloaded and checked first (report(done, total) as it comes)."""
    from huggingface_hub import constants

    if not refresh:
        try:
            return _cached(repo, quant, "")
        except HubError:
            pass
    files, why = None, "offline: HF_HUB_OFFLINE is set"
    if not constants.HF_HUB_OFFLINE:
        try:
            files = listing(repo)
        except HubError:
            raise
        except Exception as exc:  # noqa: BLE001 -- no network, a hub that is down: the cache may still hold it
            if not _unreachable(exc):
                raise HubError(f"the hub's list of {repo}'s files: {_one_line(exc)}") from None
            why = f"the hub cannot be reached ({_one_line(exc)})"
    if files is None:
        return _cached(repo, quant, why)
    chosen = choose(files, repo, quant)
    total, done = sum(f.size for f in chosen), 0
    paths = []
    for f in chosen:
        paths.append(download(repo, f, None if report is None else lambda n, _, base=done: report(base + n, total)))
        done += f.size
    return paths[0] if len(paths) == 1 else joined(paths)


def fetch_shown(repo: str, quant: str, progress, refresh: bool = False) -> Path:
    """fetch, in a progress(message) phase whose line shows the sizes (progress None: nothing shown)."""
    title = f"downloading {repo}:{quant}"
    with progress(title) if progress else nullcontext() as update:
        return fetch(repo, quant, sized(update, title), refresh)


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
            for e in entries if getattr(e, "size", None) is not None and SAFE_PATH.match(e.path)
            and ".." not in e.path.split("/")]


def hub_folder() -> Path:
    return cache_root() / "hub"


def local_path(repo: str, path: str) -> Path:
    """Where a repo's file is kept; HubError for a path that would leave the repo's folder."""
    folder = hub_folder() / repo.replace("/", "--")
    if path and (not SAFE_PATH.match(path) or ".." in path.split("/")):
        raise HubError(f"{repo} lists a file whose path cannot be kept: {path!r}")
    return folder / path


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    """This process alone works on `path` (a lock file beside it; another process waits)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def download(repo: str, file: HubFile, report: Report | None = None) -> Path:
    """The file in ladechat's cache, downloaded where it is not (the rest of a `.partial` left by
    an earlier try at the same sha256), checked against the hub's sha256: a file that fails it is
    removed, never run."""
    dest = local_path(repo, file.path)
    try:
        with _locked(dest):
            if dest.is_file() and _known(dest) in (file.sha256, None) and dest.stat().st_size == file.size:
                return dest
            partial = dest.with_name(dest.name + ".partial")
            if _known(partial) != file.sha256:  # a part of another version of the file: start over
                partial.unlink(missing_ok=True)
            _mark(partial, file.sha256)
            digest = [hashlib.sha256()]
            have = partial.stat().st_size if partial.is_file() else 0
            if have > file.size:
                partial.unlink()
                have = 0
            with open(partial, "ab") as fh:  # (created where it is not)
                pass
            with open(partial, "rb") as fh:
                while chunk := fh.read(HASH_CHUNK):
                    digest[0].update(chunk)
            if have < file.size:
                _get(repo, file, partial, have, digest, report)
            if partial.stat().st_size != file.size or (file.sha256 and digest[0].hexdigest() != file.sha256):
                partial.unlink()
                raise HubError(f"{repo}/{file.path} does not match the hub's checksum (a corrupt download): removed; "
                               "run the command again to download it anew")
            partial.replace(dest)
            _mark(dest, file.sha256)
            _mark(partial, None)
            return dest
    except HubError:
        raise
    except OSError as exc:
        if _unreachable(exc):
            raise HubError(f"downloading {repo}/{file.path} stopped ({_one_line(exc)}); run the command again to "
                           "go on where it stopped") from None
        raise HubError(f"cannot write {dest}: {exc.strerror or _one_line(exc)}") from None
    except Exception as exc:  # noqa: BLE001 -- httpx's: the connection dropped, what came is kept
        if not _unreachable(exc):
            raise HubError(f"downloading {repo}/{file.path}: {_one_line(exc)}") from None
        raise HubError(f"downloading {repo}/{file.path} stopped ({_one_line(exc)}); run the command again to go "
                       "on where it stopped") from None


def _sums(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _known(path: Path) -> str | None:
    """The sha256 that `path` is (or is a part of), as recorded beside it; None where none is."""
    try:
        return _sums(path).read_text().strip() or None
    except OSError:
        return None


def _mark(path: Path, sha256: str | None) -> None:
    if sha256 is None:
        _sums(path).unlink(missing_ok=True)
    else:
        _sums(path).write_text(sha256)


def _get(repo: str, file: HubFile, partial: Path, have: int, digest: list, report: Report | None) -> None:
    """The bytes of `file` from `have` on, appended to `partial` and to digest[0] (both started
    anew where the server sends the whole file, or cannot send that range)."""
    from urllib.parse import quote

    import httpx
    from huggingface_hub import constants
    from huggingface_hub.utils import build_hf_headers

    url = f"{constants.ENDPOINT}/{repo}/resolve/main/{quote(file.path)}"
    with httpx.Client(follow_redirects=True, timeout=httpx.Timeout(30.0, read=60.0)) as client:
        while True:
            headers = build_hf_headers()
            if have:
                headers["Range"] = f"bytes={have}-"
            with client.stream("GET", url, headers=headers) as response:
                if response.status_code in (401, 403):
                    raise HubError(f"{repo} is gated or private: accept its terms on huggingface.co, then log in "
                                   "(`hf auth login`, or HF_TOKEN)")
                if have and response.status_code == 416:  # that range cannot be sent: the whole file, asked anew
                    have, digest[0] = 0, hashlib.sha256()
                    partial.write_bytes(b"")
                    continue
                if have and (response.status_code != 206
                             or not response.headers.get("content-range", "").startswith(f"bytes {have}-")):
                    have, digest[0] = 0, hashlib.sha256()  # the whole file from its start
                response.raise_for_status()
                _write(response, partial, have, file.size, digest, report)
                return


def _write(response, partial: Path, have: int, size: int, digest: list, report: Report | None) -> None:
    with open(partial, "ab" if have else "wb") as out:
        for chunk in response.iter_bytes(1 << 20):
            out.write(chunk)
            digest[0].update(chunk)
            have += len(chunk)
            if report is not None:
                report(have, size)


def _cached(repo: str, quant: str, why: str) -> Path:
    """repo:quant from the cache alone (offline: `why`): HubError where it is not there."""
    folder = local_path(repo, "")
    files = [HubFile(str(p.relative_to(folder)), p.stat().st_size, None) for p in sorted(folder.rglob("*.gguf"))
             if p.is_file() and JOINED not in p.parts] if folder.is_dir() else []
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
            relative = path.relative_to(repo_folder)
            if path.is_file() and JOINED not in relative.parts and "mmproj" not in path.name.lower() \
                    and (quant := quant_of(str(relative))):
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
    copy = _joined_path(list(entry.paths)) if PART.search(entry.paths[0].name) else None
    files = list(entry.paths) + ([copy] if copy is not None and copy.is_file() else [])
    kept = [folder for path in files if (folder := prepared_dir(path)).is_dir()]
    for path in files:
        path.unlink()
        _mark(path, None)
    for folder in kept:
        shutil.rmtree(folder, ignore_errors=True)
    return files + kept


def _unreachable(exc: BaseException) -> bool:
    """A failure of the connection, or of the hub's side (a 5xx after huggingface_hub's retries)."""
    import httpx

    if isinstance(exc, (httpx.TransportError, ConnectionError, TimeoutError)):
        return True
    response = getattr(exc, "response", None)
    status = getattr(response, "status_code", None)
    return type(exc).__name__ == "OfflineModeIsEnabled" or (isinstance(status, int) and status >= 500)


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:200] or type(exc).__name__


JOINED = ".joined"  # the folder, in a repo's, of its files in parts joined into one


def _joined_path(parts: list[Path]) -> Path:
    """Where the parts' joined GGUF is kept: named by the parts' names, sizes and times."""
    stats = [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in parts]
    key = hashlib.sha256(json.dumps(stats).encode()).hexdigest()[:12]
    return parts[0].parent / JOINED / f"{PART.sub('', parts[0].name)}-{key}.gguf"


def joined(parts: list[Path]) -> Path:
    """One GGUF of a file's parts (gguf-split's: each part a GGUF of some of the tensors, the first
    holding the metadata), written once beside them. HubError for parts that do not join."""
    out = _joined_path(parts)
    try:
        with _locked(out):
            if not out.is_file():
                _write_joined(parts, out)
    except (ValueError, KeyError, IndexError, OSError) as exc:
        raise HubError(f"cannot join the parts of {PART.sub('', parts[0].name)}: {_one_line(exc)}") from None
    return out


def _write_joined(parts: list[Path], out: Path) -> None:
    import numpy as np
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    readers = [GGUFReader(p) for p in parts]
    arch = readers[0].fields["general.architecture"]
    writer = GGUFWriter(None, bytes(arch.parts[arch.data[0]]).decode())
    for name, field in readers[0].fields.items():
        if name.startswith(("GGUF.", "split.")) or name == "general.architecture":
            continue
        kind = field.types[0]
        if name == "general.alignment":  # the writer pads the data to it, and writes the key itself
            writer.data_alignment = int(field.contents())
            writer.add_custom_alignment(int(field.contents()))
        elif kind == GGUFValueType.ARRAY:
            writer.add_key_value(name, field.contents(), kind, sub_type=field.types[-1])
        else:
            writer.add_key_value(name, field.contents(), kind)
    for reader in readers:
        for tensor in reader.tensors:
            writer.add_tensor(tensor.name, np.asarray(tensor.data), raw_dtype=tensor.tensor_type)
    partial = out.with_name(out.name + ".partial")
    writer.write_header_to_file(partial)
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    partial.replace(out)
