"""Keep-alive (issue #30) with real processes and sockets: `ladechat ask` and the chat start a
detached warm server on a Unix socket, and the next commands answer through it.

Each test has a runtime folder of its own (LADECHAT_RUNTIME_DIR, short: a socket's path is at most
107 bytes) and opts in with LADECHAT_KEEP_ALIVE (conftest.py sets 0 for the rest of the suite);
every server a test started is gone when it ends. The commands run from a snapshot of the package
taken when this module starts (PYTHONPATH): a warm server whose code differs from the command's is
replaced, by design, and other work in this tree edits that code while these tests run.
"""

import json
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pexpect
import pytest
from conftest import PATIENCE_S, REPO

QUESTION = "What is the capital of France?"
LONG = "Write a very long story about a dragon who learns to bake bread."
COUNT = "Count from 1 to 10, separated by commas."
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory):
    root = tmp_path_factory.mktemp("snapshot")
    shutil.copytree(REPO / "ladechat", root / "ladechat", ignore=shutil.ignore_patterns("__pycache__"))
    return root


class Run:
    """A runtime folder and the commands that use it."""

    def __init__(self, snapshot: Path, keep: str = "5m") -> None:
        self.base = Path(tempfile.mkdtemp(prefix="lc-", dir="/tmp"))
        self.dir = self.base / "run"
        self.snapshot = snapshot
        self.keep = keep

    # Commands run in `base`: `python -m` puts the working directory first on sys.path, and this
    # repository's ladechat/ would come before the snapshot.
    def env(self, **extra) -> dict:
        return {**os.environ, "PYTHONPATH": str(self.snapshot), "LADECHAT_RUNTIME_DIR": str(self.dir),
                "LADECHAT_KEEP_ALIVE": self.keep, "NO_COLOR": "1", **extra}

    def command(self, *args) -> list[str]:
        return [sys.executable, "-m", "ladechat", *args]

    def __call__(self, *args, stdin=None, timeout=PATIENCE_S, **env) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(*args), input=stdin, capture_output=True, text=True, timeout=timeout,
                              env=self.env(**env), cwd=self.base, check=False)

    def popen(self, *args, **env) -> subprocess.Popen:
        return subprocess.Popen(self.command(*args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=self.env(**env), cwd=self.base)

    def daemons(self) -> list[int]:
        """The pids of the warm servers of this folder that are alive (from their command lines)."""
        found = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    cmdline = (entry / "cmdline").read_bytes().split(b"\0")
                    status = (entry / "stat").read_text()
                except OSError:
                    continue
                if (b"ladechat.keepalive.daemon" in cmdline and str(self.dir).encode() in cmdline
                        and status.rsplit(")", 1)[-1].split()[0] != "Z"):
                    found.append(int(entry.name))
        return found

    def pid(self) -> int:
        pids = self.daemons()
        assert len(pids) == 1, pids
        return pids[0]

    def log(self) -> str:
        return "".join(p.read_text() for p in self.dir.glob("*.log"))

    def health(self) -> dict:
        sock = next(self.dir.glob("*.sock"))
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(sock))) as client:
            return client.get("http://warm/health").json()

    def wait_gone(self, pid: int, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while pid in self.daemons():
            assert time.monotonic() < deadline, f"warm server {pid} still running"
            time.sleep(0.1)

    def close(self) -> None:
        for pid in self.daemons():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(self.base, ignore_errors=True)


@pytest.fixture()
def fresh(snapshot):
    """A new runtime folder per call; the servers started in them end with the test."""
    runs = []

    def make(keep: str = "5m") -> Run:
        runs.append(Run(snapshot, keep))
        return runs[-1]

    yield make
    for run in runs:
        run.close()


@pytest.fixture(scope="module")
def warm(snapshot):
    """One runtime folder shared by the tests that need a warm fp32 server (started by the first)."""
    run = Run(snapshot)
    yield run
    run.close()


def tcp_listeners(pid: int) -> set[int]:
    """The inodes of the TCP sockets process `pid` listens on."""
    mine = {int(m.group(1)) for fd in Path(f"/proc/{pid}/fd").iterdir()
            if (m := re.fullmatch(r"socket:\[(\d+)\]", os.readlink(fd)))}
    listening = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A":  # LISTEN
                listening.add(int(fields[9]))
    return mine & listening


def stays_loaded(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "stays loaded for" in line]


def one_line_error(r, *needles) -> str:
    assert r.returncode == 1, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ladechat: error: "), r.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


# -- one shared warm server ---------------------------------------------------------------------
def test_two_asks_share_one_server_and_answer_as_in_process(warm):
    args = ["ask", "--json", "--dtype", "float32", "--max-new-tokens", "24", QUESTION]
    first = warm(*args)
    assert first.returncode == 0, first.stderr
    assert len(stays_loaded(first.stderr)) == 1  # said once, when it starts
    pid = warm.pid()
    # a private folder, a socket only this user may use, no TCP port
    assert stat.S_IMODE(warm.dir.stat().st_mode) == 0o700
    (sock,) = warm.dir.glob("*.sock")
    assert stat.S_ISSOCK(sock.lstat().st_mode) and stat.S_IMODE(sock.lstat().st_mode) == 0o600
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in warm.dir.glob("*.l*"))
    assert not tcp_listeners(pid)

    second = warm(*args)
    assert second.returncode == 0, second.stderr
    assert stays_loaded(second.stderr) == [] and warm.daemons() == [pid], (second.stderr, warm.log())
    local = warm(*args, "--keep-alive", "0")  # in this process, as before keep-alive
    assert local.returncode == 0, local.stderr
    answers = [json.loads(r.stdout) for r in (first, second, local)]
    assert answers[0]["token_ids"] == answers[1]["token_ids"] == answers[2]["token_ids"]
    assert answers[0]["text"] == answers[1]["text"] == answers[2]["text"]
    assert answers[0]["model"] == answers[2]["model"]
    assert warm.daemons() == [pid]

    ps = warm("ps")
    assert ps.returncode == 0, ps.stderr
    header, row = ps.stdout.strip().splitlines()
    assert header.split() == ["MODEL", "DEVICE", "OPTIONS", "MEMORY", "UNTIL", "PID"]
    assert "SmolLM2-135M-Instruct" in row and "cpu float32" in row and "dtype=float32" in row
    assert re.search(r"\d+ MiB", row) and "from now" in row and row.endswith(str(pid))


def test_settings_stop_strings_and_the_store_travel_with_each_request(warm):
    def stored() -> int:  # the answers in the model's store of past answers
        found = re.search(r"^SmolLM2[^\t]*\t(\d+) answers", warm("store", "list").stdout, re.MULTILINE)
        return int(found.group(1)) if found else 0

    args = ["ask", "--json", "--dtype", "float32", "--no-lookahead", "--max-new-tokens", "40", COUNT]
    before = stored()
    whole = warm(*args, "--no-store")
    assert whole.returncode == 0, whole.stderr
    assert stored() == before  # not added: --no-store went with the request
    record = json.loads(whole.stdout)
    assert record["stats"]["lookahead"] is False and record["stats"]["new_tokens"] <= 40
    text = record["text"]
    stop = text[len(text) // 2:][:3]
    cut = warm(*args, "--stop", stop)
    assert cut.returncode == 0, cut.stderr
    record = json.loads(cut.stdout)
    assert record["stats"]["finish_reason"] == "stop"
    assert record["text"] == text[:text.index(stop) + len(stop)]  # the stop string kept, as in-process
    assert stored() == before + 1
    plain = warm("ask", "--dtype", "float32", "--no-lookahead", "--max-new-tokens", "40", "--stop", stop, COUNT)
    assert plain.stdout.rstrip("\n") == record["text"]
    # the sampling and lookahead settings of a request are that request's alone
    looked = warm("ask", "--json", "--dtype", "float32", "-W", "3", "-N", "4", "--max-new-tokens", "8", QUESTION)
    stats = json.loads(looked.stdout)["stats"]
    assert (stats["lookahead"], stats["W"], stats["N"]) == (True, 3, 4)
    prompts = [json.loads(warm("ask", "--json", "--dtype", "float32", "--max-new-tokens", "2", *extra, QUESTION).stdout)
               ["stats"]["prompt_tokens"] for extra in ([], ["--template", "zephyr"])]
    assert prompts[0] != prompts[1]  # the template went with the request
    bad = warm("ask", "--dtype", "float32", "--template", "nope", QUESTION)
    one_line_error(bad, "unknown template 'nope'")
    assert len(warm.daemons()) == 1


def test_ctrl_c_stops_the_answer_and_the_server_keeps_serving(snapshot, tmp_path):
    """A model with no end-of-text token asked for a long answer, in a runtime folder of its own:
    the answer cannot end before the signal."""
    from tiny_models import endless_model_folder

    folder = str(endless_model_folder(tmp_path / "endless"))
    run = Run(snapshot)
    try:
        proc = run.popen("ask", "--model", folder, "--dtype", "float32", "--max-new-tokens", "200000",
                         "Tell me a story.")
        assert proc.stdout.read(20)  # it is answering
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 130
        assert "interrupted" in proc.stderr.read()
        pid = run.pid()
        deadline = time.monotonic() + 30
        while run.health()["running"] or "client gone: stopped after" not in run.log():
            assert time.monotonic() < deadline, run.log()
            time.sleep(0.1)
        stopped = int(re.findall(r"client gone: stopped after (\d+) new tokens", run.log())[-1])
        assert stopped < 200000
        again = run("ask", "--model", folder, "--dtype", "float32", "--max-new-tokens", "8", "Hi")
        assert again.returncode == 0 and again.stdout.strip(), again.stderr
        assert run.daemons() == [pid]
    finally:
        run.close()


def test_the_chat_answers_through_the_warm_server_without_torch(warm, tmp_path):
    pid = warm.pid()
    env = warm.env(XDG_STATE_HOME=str(tmp_path / "state"), TERM="xterm", PROMPT_TOOLKIT_NO_CPR="1")
    child = pexpect.spawn(sys.executable, ["-m", "ladechat", "--dtype", "float32", "--max-new-tokens", "24"], env=env,
                          encoding="utf-8", timeout=60, dimensions=(40, 200), cwd=str(warm.base))
    child.expect(r"kept\s+loaded")
    child.expect(">>>")
    child.sendline(QUESTION)
    child.expect(r"tokens/step, lookahead W=")
    child.expect(">>>")
    child.sendline("/store off")
    child.expect("store of past answers off")
    child.expect(">>>")
    child.sendline("/set template=chatml temperature=0")
    child.expect("W=")
    child.expect(">>>")
    child.sendline("Name a colour.")
    child.expect(r"tokens/step")
    child.expect(">>>")
    child.sendline("/store clear")
    child.expect(r"store cleared: \d+ past answers? forgotten")
    child.expect(">>>")
    child.sendeof()
    child.expect(pexpect.EOF)
    # neither ask nor the chat imports torch or transformers when a server holds the model
    check = ("import sys\nfrom ladechat.cli import main\ntry:\n    main()\nfinally:\n"
             "    print('heavy:', sorted(m for m in ('torch', 'transformers') if m in sys.modules), file=sys.stderr)\n")
    for args, stdin in ((["ask", "--dtype", "float32", "--max-new-tokens", "4", "hi"], None),
                        (["--dtype", "float32", "--max-new-tokens", "4"], "hi\n/stats\n")):
        r = subprocess.run([sys.executable, "-c", check, *args], input=stdin, capture_output=True, text=True,
                           timeout=120, env=warm.env(), cwd=warm.base, check=False)
        assert r.returncode == 0, r.stderr
        assert "heavy: []" in r.stderr and "tokens/step" in r.stderr
    assert warm.daemons() == [pid]


def test_a_server_killed_mid_answer(snapshot, tmp_path):
    """A model with no end-of-text token asked for long answers, in a runtime folder of its own: each
    answer is still running when its server is killed."""
    from tiny_models import endless_model_folder

    folder = str(endless_model_folder(tmp_path / "endless"))
    run = Run(snapshot)
    try:
        proc = run.popen("ask", "--model", folder, "--dtype", "float32", "--max-new-tokens", "200000", "Tell me.")
        assert proc.stdout.read(20)
        os.kill(run.pid(), signal.SIGKILL)
        assert proc.wait(60) == 1
        stderr = proc.stderr.read()
        error = stderr.strip().splitlines()[-1]
        assert error.startswith(f"ladechat: error: the warm server of {folder}") and "stopped mid-answer" in error
        assert "Traceback" not in stderr
        assert list(run.dir.glob("*.sock"))  # its socket is left behind, stale
        # the next command (a chat) loads it again; killed mid-answer there, the question stays for /retry
        env = run.env(XDG_STATE_HOME=str(tmp_path / "state"), TERM="xterm", PROMPT_TOOLKIT_NO_CPR="1")
        child = pexpect.spawn(sys.executable, ["-m", "ladechat", "--model", folder, "--dtype", "float32",
                                               "--max-new-tokens", "4", "--no-lookahead"], env=env, encoding="utf-8",
                              timeout=180, dimensions=(40, 200), cwd=str(run.base))
        child.expect(">>>")
        child.sendline("Hi")
        child.expect("stays loaded for 5m")
        child.expect("tokens/step")
        child.expect(">>>")
        child.sendline("/set max_new_tokens=200000")
        child.expect("lookahead off: W=")  # what /set says: not the typed line's echo
        child.expect(">>>")
        pid = run.pid()
        child.sendline("Tell me a story.")
        # killed once the answer shows (before it began, the chat would start a server and ask again)
        child.expect_exact("\x1b[?2004l")  # the question sent: what the screen shows next is the answer
        child.expect(r"[!-~]{20}")  # twenty printable characters of it in a row
        os.kill(pid, signal.SIGKILL)
        child.expect("stopped mid-answer")
        child.expect("/retry")
        child.expect(">>>")
        child.sendline("/set max_new_tokens=4")
        child.expect("lookahead off: W=")
        child.expect(">>>")
        child.sendline("/retry")
        child.expect("stays loaded for 5m")  # started again
        child.expect("tokens/step")
        child.expect(">>>")
        child.sendeof()
        child.expect(pexpect.EOF)
        assert run.pid() != pid
    finally:
        run.close()


# -- servers of their own -----------------------------------------------------------------------
def test_concurrent_first_asks_start_one_server_which_expires_when_idle(fresh):
    run = fresh(keep="4s")
    procs = [run.popen("ask", "--json", "--no-lookahead", "--max-new-tokens", "8", QUESTION) for _ in range(3)]
    results = [(p.wait(300), p.stdout.read(), p.stderr.read()) for p in procs]
    assert all(code == 0 for code, _, _ in results), results
    assert len({json.dumps(json.loads(out)["token_ids"]) for _, out, _ in results}) == 1
    assert sum(len(stays_loaded(err)) for _, _, err in results) == 1  # exactly one started it
    assert run.log().count("loading the embedded model") == 1
    pid = run.pid()
    assert run("ps").stdout.count("SmolLM2") == 1
    run.wait_gone(pid, timeout=60)  # 4 s after the last answer
    assert "idle for 4 s: stopping" in run.log()
    assert not list(run.dir.glob("*.sock")) and not list(run.dir.glob("*.lock"))
    ps = run("ps")
    assert ps.returncode == 0 and ps.stdout == "" and "no model is kept loaded" in ps.stderr


def test_a_server_of_another_version_is_replaced_and_stop_unloads(fresh, snapshot, tmp_path):
    old = tmp_path / "old"
    shutil.copytree(snapshot / "ladechat", old / "ladechat")
    init = old / "ladechat" / "__init__.py"
    init.write_text(init.read_text().replace('__version__ = "', '__version__ = "0.0.1-old-'))
    run = fresh()
    first = run("ask", "--max-new-tokens", "4", QUESTION, PYTHONPATH=str(old))
    assert first.returncode == 0, first.stderr
    old_pid = run.pid()
    second = run("ask", "--max-new-tokens", "4", QUESTION)
    assert second.returncode == 0, second.stderr
    (replaced,) = [line for line in second.stderr.splitlines() if "replaced by this version" in line]
    assert "0.0.1-old-" in replaced
    run.wait_gone(old_pid)
    new_pid = run.pid()
    assert new_pid != old_pid
    # ladechat stop: by the model's name; then there is nothing left to stop
    stopped = run("stop", "SmolLM2-135M-Instruct")
    assert stopped.returncode == 0 and f"unloaded SmolLM2-135M-Instruct (embedded, Q4_1) (pid {new_pid})" in stopped.stderr
    assert run.daemons() == []
    again = run("stop", "--all")
    assert again.returncode == 0 and "no model is kept loaded" in again.stderr
    one_line_error(run("stop", "nothing-like-it"), "no warm server holds 'nothing-like-it'")


def test_a_server_killed_while_loading_and_a_model_that_does_not_load(fresh, tmp_path):
    run = fresh()
    proc = run.popen("ask", "--max-new-tokens", "4", QUESTION)
    deadline = time.monotonic() + 120
    while not run.daemons():
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.05)
    os.kill(run.pid(), signal.SIGKILL)  # as soon as it exists: it cannot have loaded the model yet
    assert proc.wait(60) == 1
    lines = proc.stderr.read().strip().splitlines()
    assert lines[-1].startswith("ladechat: error: the warm server for the embedded model ended while loading it "
                                "(killed by SIGKILL"), lines
    assert run.daemons() == []
    # the reason a model does not load is the command's one-line error, as in-process
    folder = tmp_path / "not-a-model"
    folder.mkdir()
    r = run("ask", "--model", str(folder), QUESTION)
    one_line_error(r, f"{folder} is not a model folder (no config.json in it)")
    for pid in run.daemons():
        run.wait_gone(pid, timeout=10)  # it ends right after saying why
    assert not list(run.dir.glob("*.sock"))


def test_refused_folders_sockets_and_flags(fresh):
    run = fresh()
    run.dir.mkdir(mode=0o755)
    run.dir.chmod(0o755)
    one_line_error(run("ask", QUESTION), f"the runtime folder {run.dir} is open to other users (mode 755)",
                   f"chmod 700 {run.dir}")
    run.dir.chmod(0o700)
    one_line_error(run("ask", "--keep-alive", "5 minutes", QUESTION), "--keep-alive wants a duration such as 5m")
    one_line_error(run("ask", "-N", "0", QUESTION), "N (n-gram size) must be >= 2, got 0")
    long = fresh()
    r = long("ask", QUESTION, LADECHAT_RUNTIME_DIR=str(long.base / ("x" * 100)))
    one_line_error(r, "longer than the 107 bytes")
    assert run.daemons() == [] and long.daemons() == []
    if os.getuid() != 0:
        return  # another user's files: only root can make them here
    # a socket that is not this user's (e.g. left by someone else in a shared folder) is refused
    code = "import os; from ladechat.keepalive.runtime import ServerKey; print(ServerKey.of({}, os.environ).key())"
    key = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=run.env(), cwd=run.base,
                         check=True).stdout.strip()
    sock_path = run.dir / f"{key}.sock"
    planted = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    planted.bind(str(sock_path))
    os.chown(sock_path, 65534, 65534)
    one_line_error(run("ask", QUESTION), f"{sock_path} belongs to user 65534", "refused")
    planted.close()
    sock_path.unlink()
    other = fresh()
    other.dir.mkdir(mode=0o700)
    os.chown(other.dir, 65534, 65534)
    one_line_error(other("ask", QUESTION), f"the runtime folder {other.dir} belongs to user 65534")
    assert run.daemons() == [] and other.daemons() == []
