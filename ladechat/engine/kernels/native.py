"""ladechat's own CPU kernels: C++ sources in this package, compiled once per machine into the
user cache and loaded as torch operators.

A wheel with compiled code would need a build per platform and torch version; the kernels are
small, so the first load compiles them with the system's C++ compiler against the installed
torch's headers (seconds a library, shown as a status line; model loading starts it on a background
thread, prebuild(), so that it overlaps the model's conversion) and later loads only open the library.
The library's name holds digests of the source and of the compiler and flags, and the torch
version, so a change to any of them compiles afresh (a library of the same source built before
still serves if the compiler has gone since). No compiler, or one that fails: the caller gets the
reason (one line) and keeps its torch path; nothing is half-built (the library is renamed into
place whole).
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

import torch

COMPILER = "c++"
COMPILE_TIMEOUT_S = 300


class BuildError(RuntimeError):
    """A kernel library could not be compiled or loaded; the message is one line."""


_loaded: dict[Path, Path] = {}  # source -> the library this process loaded for it (torch keeps it)


def library_path(source: Path, folder: Path, compiler_id: str) -> Path:
    """Named for what went into it: the source, then the compiler (compiler_id: its path and
    version) with the compile flags, then the torch version. Not where torch is installed: every
    environment with this torch shares the library."""
    build = hashlib.sha256(" ".join([compiler_id, *_flags()]).encode()).hexdigest()[:8]
    return folder / f"{_source_prefix(source)}{build}-torch{torch.__version__}.so"


def _source_prefix(source: Path) -> str:
    return f"{Path(source).stem}-{hashlib.sha256(Path(source).read_bytes()).hexdigest()[:12]}-"


def built_before(source: Path, folder: Path) -> Path | None:
    """A library of this very source for this torch, built by whatever compiler was there then."""
    built = sorted(Path(folder).glob(f"{_source_prefix(source)}*-torch{torch.__version__}.so"),
                   key=lambda path: path.stat().st_mtime_ns)
    return built[-1] if built else None


def _flags() -> list[str]:
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)  # must match torch's, or its symbols do not link
    return ["-O3", "-std=c++17", "-shared", "-fPIC", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
            "-fopenmp",  # at::parallel_for's OpenMP regions; the process's libgomp is torch's own
            "-ffp-contract=off",  # a * b + c as written, two roundings: as torch's separate ops compute it
            "-w"]


def compile_command(source: Path, output: Path, compiler: str) -> list[str]:
    from torch.utils.cpp_extension import include_paths, library_paths

    return [compiler, *_flags(), *[f"-I{p}" for p in include_paths()], str(source), "-o", str(output),
            *[f"-L{p}" for p in library_paths()], "-lc10", "-ltorch_cpu"]


def load(source: Path, folder: Path, compiler: str = COMPILER,
         progress: Callable[[str], AbstractContextManager] | None = None) -> Path:
    """Compile `source` into `folder` unless done before, and load its operators into torch;
    returns the library. BuildError says why not."""
    source = Path(source)
    with _lock(source):  # one build at a time per source: a load() waits for prebuild()'s
        return _load_once(source, Path(folder), compiler, progress)


def why_not_loaded(source: Path, folder: Path, compiler: str = COMPILER,
                   progress: Callable[[str], AbstractContextManager] | None = None) -> str | None:
    """load(), for a caller with a torch path to fall back on: None once loaded, else why not (one line)."""
    try:
        load(source, folder, compiler, progress)
    except BuildError as exc:
        return str(exc)
    return None


def prebuild(sources: list[Path], folder: Path, compiler: str = COMPILER) -> threading.Thread:
    """Build and load `sources` on a background thread, so that a first run's compiles overlap
    the model's conversion (seconds each, on one core): a load() of one of them then waits
    for it instead of compiling again. What fails is left for that load() to report."""
    def build_all() -> None:
        for source in sources:
            try:
                load(source, folder, compiler)
            except BuildError:
                pass

    thread = threading.Thread(target=build_all, name="ladechat-kernels", daemon=True)
    thread.start()
    return thread


_locks: dict[Path, threading.Lock] = {}
_locks_lock = threading.Lock()


def _lock(source: Path) -> threading.Lock:
    with _locks_lock:
        return _locks.setdefault(source, threading.Lock())


def _load_once(source: Path, folder: Path, compiler: str,
               progress: Callable[[str], AbstractContextManager] | None) -> Path:
    if source in _loaded:
        return _loaded[source]
    found = shutil.which(compiler)
    try:
        if found is None:  # gone since it built the library, say: that library still serves
            path = built_before(source, folder)
            if path is None:
                raise BuildError(f"no C++ compiler ({compiler}) to build {source.name}")
        else:
            path = library_path(source, folder, _version(found))
            if not path.is_file():
                _build(source, path, found, compiler, progress)
    except (OSError, subprocess.SubprocessError) as exc:  # a cache that cannot be written, a compiler that cannot run
        raise BuildError(f"cannot build {source.name}: {' '.join(str(exc).split())}") from None
    try:
        torch.ops.load_library(str(path))
    except (OSError, RuntimeError) as exc:
        raise BuildError(f"cannot load {path.name}: {' '.join(str(exc).split())}") from None
    _loaded[source] = path
    return path


def loaded(source: Path) -> bool:
    """Whether this process has loaded the library of `source` (its operators are there)."""
    return Path(source) in _loaded


def _version(compiler: str) -> str:
    """The compiler and its version, as the library's name takes them (an upgrade builds afresh)."""
    done = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60, check=False)
    return f"{compiler} {done.stdout.splitlines()[0] if done.stdout else ''}"


def _build(source: Path, path: Path, compiler: str, name: str,
           progress: Callable[[str], AbstractContextManager] | None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    status = progress(f"Compiling ladechat's {source.stem} kernels (one time, 10-15 s)") if progress else nullcontext()
    with status, tempfile.TemporaryDirectory(dir=path.parent) as scratch:
        built = Path(scratch) / path.name
        try:
            done = subprocess.run(compile_command(source, built, compiler), capture_output=True, text=True,
                                  timeout=COMPILE_TIMEOUT_S, check=False)
        except subprocess.TimeoutExpired:
            raise BuildError(f"compiling {source.name} took over {COMPILE_TIMEOUT_S} s") from None
        if done.returncode != 0:
            errors = [line for line in done.stderr.splitlines() if "error" in line] or done.stderr.splitlines()
            detail = errors[0].strip() if errors else f"exit status {done.returncode}"
            raise BuildError(f"{name} could not compile {source.name}: {detail}")
        built.rename(path)  # whole, or not at all
