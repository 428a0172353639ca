"""Where warm servers live and who may use them.

One private folder per user (0700, refused if it is anyone else's or open to others) holds, per set
of load options (its key, a digest of the options):

    KEY.lock   held (flock) by the server for its whole life, and by the command starting it; a
               file nobody holds belongs to no live server. It holds the server's pid and options.
    KEY.sock   the server's socket (0600), made once the model is loaded
    KEY.log    the server's own output (what it logs, and a traceback if it crashes)

The folder: $LADECHAT_RUNTIME_DIR, else $XDG_RUNTIME_DIR/ladechat, else /run/user/UID/ladechat
when that is the user's, else the cache folder's ladechat/run (as platformdirs' user_runtime_dir
would pick, with the cache folder where a system has no runtime folder).
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import os
import re
import stat
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ladechat import __version__
from ladechat.backends.spec import LOAD_DEFAULTS, flag_of
from ladechat.errors import UserError
from ladechat.paths import cache_root

FOREVER = -1.0  # --keep-alive -1 (any negative duration)
SOCKET_PATH_MAX = 103 if sys.platform == "darwin" else 107  # sun_path less its NUL byte
# Environment that changes which devices and files a load sees: part of a server's identity too
# (the rest of the environment is the starting command's, e.g. HF_HUB_OFFLINE or OMP_NUM_THREADS).
LOAD_ENVIRONMENT = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "XDG_CACHE_HOME", "HF_HOME")
UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


class WarmError(UserError):
    """A warm server cannot be found, started or used; the message is one line."""


# -- durations --------------------------------------------------------------------------------
LONGEST = 10 * 365 * 86400  # a duration past ten years is forever (a clock cannot say when it ends)


def parse_duration(text: str) -> float:
    """--keep-alive / LADECHAT_KEEP_ALIVE, as ollama's keep_alive: '5m', '30s', '1h30m', '300'
    (seconds), '0' (keep nothing), '-1' or any negative duration, or one past LONGEST (forever).
    Seconds; FOREVER < 0."""
    t = text.strip().lower()
    if re.fullmatch(r"-\d+(\.\d+)?(ms|s|m|h|d)?", t):
        return FOREVER
    if re.fullmatch(r"\d+(\.\d+)?", t):
        return FOREVER if float(t) > LONGEST else float(t)
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)", t)
    if not parts or "".join(a + b for a, b in parts) != t:
        raise WarmError(f"--keep-alive wants a duration such as 5m, 30s, 1h30m, 0 (load in this command, keep "
                        f"nothing) or -1 (forever), got {text!r}")
    seconds = sum(float(amount) * UNITS[unit] for amount, unit in parts)
    return FOREVER if seconds > LONGEST else seconds


def format_duration(seconds: float) -> str:
    if seconds < 0:
        return "forever"
    if seconds < 60 and seconds != int(seconds):
        return f"{seconds:g}s"
    whole = round(seconds)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    text = (f"{hours}h" if hours else "") + (f"{minutes}m" if minutes else "") + (f"{secs}s" if secs else "")
    return text or "0s"


# -- the folder -------------------------------------------------------------------------------
def runtime_root(environ: Mapping[str, str]) -> Path:
    """The folder of this user's warm servers (see the module's docstring); created by private_folder."""
    if environ.get("LADECHAT_RUNTIME_DIR"):
        return Path(environ["LADECHAT_RUNTIME_DIR"]).expanduser()
    if environ.get("XDG_RUNTIME_DIR") and os.path.isabs(environ["XDG_RUNTIME_DIR"]):
        return Path(environ["XDG_RUNTIME_DIR"]) / "ladechat"
    run_user = Path(f"/run/user/{os.getuid()}")
    try:
        st = os.stat(run_user)
        if st.st_uid == os.getuid() and stat.S_ISDIR(st.st_mode) and not st.st_mode & 0o077:
            return run_user / "ladechat"
    except OSError:
        pass
    return cache_root(environ) / "run"


def private_folder(path: Path) -> Path:
    """`path`, made (0700) if need be, once it is known to be a folder of this user's that nobody
    else may enter; WarmError otherwise (nothing in it is trusted then)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise WarmError(f"cannot make the runtime folder {path}: {exc.strerror or exc}") from None
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise WarmError(f"the runtime folder {path} is not a folder (a link or a file): refused; remove it")
    if st.st_uid != os.getuid():
        raise WarmError(f"the runtime folder {path} belongs to user {st.st_uid}, not to you ({os.getuid()}): refused; "
                        "set LADECHAT_RUNTIME_DIR to a folder of yours, or use --keep-alive 0")
    if st.st_mode & 0o077:
        raise WarmError(f"the runtime folder {path} is open to other users (mode {stat.S_IMODE(st.st_mode):o}): "
                        f"refused; chmod 700 {path}")
    return path


def check_owned(path: Path, socket: bool = False) -> bool:
    """Whether `path` exists; WarmError when it is not this user's (or, socket: not a socket)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    if st.st_uid != os.getuid():
        raise WarmError(f"{path} belongs to user {st.st_uid}, not to you ({os.getuid()}): refused; remove it")
    if socket and not stat.S_ISSOCK(st.st_mode):
        raise WarmError(f"{path} is not a socket: refused; remove it")
    return True


@dataclass(frozen=True)
class Paths:
    """The files of the warm server for one key."""

    root: Path
    key: str

    @property
    def sock(self) -> Path:
        return self.root / f"{self.key}.sock"

    @property
    def lock(self) -> Path:
        return self.root / f"{self.key}.lock"

    @property
    def log(self) -> Path:
        return self.root / f"{self.key}.log"

    def check_length(self) -> None:
        if len(os.fsencode(self.sock)) > SOCKET_PATH_MAX:
            raise WarmError(f"the socket path {self.sock} is longer than the {SOCKET_PATH_MAX} bytes a Unix socket's "
                            "name may have; set LADECHAT_RUNTIME_DIR to a shorter folder")

    @staticmethod
    def all(root: Path) -> list[Paths]:
        """Every key that has a lock file in `root` (live servers, and files of dead ones)."""
        return [Paths(root, p.name[:-len(".lock")]) for p in sorted(root.glob("*.lock"))]


# -- the lock ---------------------------------------------------------------------------------
def try_lock(path: Path) -> int | None:
    """An fd holding the exclusive lock on `path` (made 0600 if need be), or None while a live
    server (or a command starting one) holds it. The fd is inheritable: a started server keeps it."""
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        except OSError as exc:
            raise WarmError(f"cannot open {path}: {exc.strerror or exc}") from None
        owner = os.fstat(fd).st_uid
        if owner != os.getuid():
            os.close(fd)
            raise WarmError(f"{path} belongs to user {owner}, not to you ({os.getuid()}): refused; remove it")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        # Its last holder may have removed the file (and another made it anew) since it was opened:
        # a lock on a file no longer at `path` guards nothing.
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            os.set_inheritable(fd, True)
            return fd
        os.close(fd)


def is_held(path: Path) -> bool:
    """Whether a live server (or a command starting one) holds the lock at `path`."""
    fd = try_lock(path)
    if fd is None:
        return True
    os.close(fd)
    return False


def read_record(path: Path) -> dict:
    """What the server holding the lock at `path` wrote in it (pid, options, version); {} if nothing yet."""
    try:
        check_owned(path)
        data = json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def write_record(fd: int, record: dict) -> None:
    data = json.dumps(record).encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)


def remove_files(paths: Paths, lock_fd: int, sock_inode: int | None = None) -> None:
    """Remove a server's socket (only the one with inode `sock_inode`, when given: a newer server's
    stays) and its lock file, then let go of the lock (held through `lock_fd`)."""
    try:
        if sock_inode is None or os.lstat(paths.sock).st_ino == sock_inode:
            os.unlink(paths.sock)
    except FileNotFoundError:
        pass
    try:
        os.unlink(paths.lock)
    except FileNotFoundError:
        pass
    os.close(lock_fd)


# -- what a server is ---------------------------------------------------------------------------
@dataclass(frozen=True)
class ServerKey:
    """The load options of a warm server (LOAD_DEFAULTS' keys) and the environment that changes what
    a load sees (LOAD_ENVIRONMENT). Two commands share a server exactly when their ServerKeys are equal."""

    options: dict
    environment: dict

    @staticmethod
    def of(options: dict, environ: Mapping[str, str]) -> ServerKey:
        unknown = set(options) - set(LOAD_DEFAULTS)
        if unknown:
            raise ValueError(f"not load options: {sorted(unknown)}")
        opts = {**LOAD_DEFAULTS, **options}
        if opts["model"] is not None:  # a folder or file: the server runs elsewhere (cwd /)
            path = os.path.expanduser(opts["model"])
            if os.path.exists(path):
                opts["model"] = os.path.abspath(path)
        return ServerKey(opts, {k: environ[k] for k in LOAD_ENVIRONMENT if k in environ})

    def as_json(self) -> str:
        return json.dumps({"options": self.options, "environment": self.environment}, sort_keys=True)

    @staticmethod
    def from_json(text: str) -> ServerKey:
        data = json.loads(text)
        return ServerKey({**LOAD_DEFAULTS, **data["options"]}, dict(data["environment"]))

    @staticmethod
    def from_options(options: dict) -> ServerKey:
        """A ServerKey of these options (as a server's record gives them), for showing them."""
        return ServerKey({**LOAD_DEFAULTS, **{k: v for k, v in options.items() if k in LOAD_DEFAULTS}}, {})

    def key(self) -> str:
        return hashlib.sha256(self.as_json().encode()).hexdigest()[:16]

    @property
    def model(self) -> str:
        return self.options["model"] or "the embedded model"

    def describe_options(self) -> str:
        """The options that differ from the defaults, as flags would give them ('-' for none)."""
        given = [(flag_of(k).removeprefix("--"), v) for k, v in self.options.items()
                 if k != "model" and v != LOAD_DEFAULTS[k]]
        return " ".join(k if v is True else f"{k}={v}" for k, v in given) or "-"


@functools.cache
def build() -> str:
    """This ladechat's version and a digest of its code (the package's .py and template files): a
    server built from other code, an upgrade or an edit, is replaced rather than used."""
    package = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*")):
        if path.suffix in (".py", ".jinja") and "__pycache__" not in path.parts:
            digest.update(str(path.relative_to(package)).encode() + b"\0")
            try:
                digest.update(path.read_bytes())
            except OSError:
                pass
    return f"{__version__}+{digest.hexdigest()[:12]}"
