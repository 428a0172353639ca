import atexit
import os
import shutil
import signal
import tempfile
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
# How long a test waits for a child process or thread before calling it hung: a guard, never a speed
# limit (a model load of 20 s on a quiet 2-core machine takes minutes on one kept busy).
PATIENCE_S = 1200
SHARED_DATA = REPO.parent / "shared" / "data"


def _test_cache_home() -> Path:
    """A cache folder for this test run, so the answers tests give go into stores that vanish with
    it rather than the user's; what is slow to rebuild and never changes an answer (the converted
    embedded model, step-cost curves, mask-probe verdicts, compiled kernels) is linked from the
    user's cache."""
    from ladechat.engine.load.gguf import files as gguf_files
    from ladechat.errors import ModelNotFound

    user = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ladechat"
    home = Path(tempfile.mkdtemp(prefix="ladechat-test-cache-"))
    (home / "ladechat" / "models").mkdir(parents=True)
    for shared in ("step-cost", "mask-probe", "kernels"):
        (user / shared).mkdir(parents=True, exist_ok=True)
        (home / "ladechat" / shared).symlink_to(user / shared)
    # of the models' folders, only the embedded model's: the GGUF files tests write have folders of
    # their own, which would pile up in the user's cache run after run
    try:
        embedded = gguf_files.prepared_dir(gguf_files.embedded_gguf())  # the user's, XDG_CACHE_HOME not yet changed
    except ModelNotFound:
        embedded = None
    if embedded is not None and (embedded / "complete").is_file():
        (home / "ladechat" / "models" / embedded.name).symlink_to(embedded)
    atexit.register(shutil.rmtree, home, ignore_errors=True)  # removes the links, not what they point to
    return home


# Set before any test runs: in-process code and every `ladechat` subprocess read it. The state
# folder (input history, kept chats) too: a chat a test drives is never kept among the user's.
os.environ["XDG_CACHE_HOME"] = str(_test_cache_home())
_STATE_HOME = tempfile.mkdtemp(prefix="ladechat-test-state-")
atexit.register(shutil.rmtree, _STATE_HOME, ignore_errors=True)
os.environ["XDG_STATE_HOME"] = _STATE_HOME
# The children the suite sends SIGINT (ask, serve) get it as a command typed at a terminal does. A
# suite started as a script's background job inherits SIGINT ignored, and so would they (a
# non-interactive child keeps it so, as such a job should; the chat takes it back itself); a
# handler here is reset to the default in every child.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
# Every `ladechat ask` and chat of the suite loads its model itself and keeps nothing (a warm server
# would outlive the test that started it); tests/test_keepalive.py opts in, in folders of its own.
os.environ["LADECHAT_KEEP_ALIVE"] = "0"


# The fast tier (`make test-fast`: pytest -m "not slow"), for the edit-test loop: these modules, less
# their tests marked slow. Every other module is slow as a whole (it loads models or starts processes):
# a new test file joins the fast tier by being named here.
FAST_MODULES = {"test_units", "test_settings", "test_templates", "test_text_stream", "test_structure", "test_docs",
                "test_embedding", "test_header", "test_pending", "test_template_injection", "test_q4", "test_q5", "test_q6", "test_q8", "test_half",
                "test_attend", "test_norms", "test_top_k", "test_sampling", "test_files", "test_thinking", "test_dequantize"}


def pytest_collection_modifyitems(items):
    for item in items:
        if item.module.__name__.rpartition(".")[2] not in FAST_MODULES:
            item.add_marker(pytest.mark.slow)


def _kernels_built(source: Path) -> None:
    """A kernel library loaded, built into the suite's kernel cache if not yet; the test skipped
    where no C++ compiler builds it (tests/test_int4.py covers loading without one)."""
    from ladechat.engine.kernels import native
    from ladechat.paths import cache_root

    if shutil.which(native.COMPILER) is None:
        pytest.skip(f"no C++ compiler ({native.COMPILER}) to build the kernels here")
    assert native.why_not_loaded(source, cache_root() / "kernels") is None


@pytest.fixture(scope="module")
def kernel():
    """blocks.cpp's library: the block products (tests/kernels/: q4, q5, q6, half)."""
    from ladechat.engine.kernels import q4

    _kernels_built(q4.SOURCE)


@pytest.fixture(scope="module")
def step_kernel():
    """step_ops.cpp's library: a step's small ops (tests/kernels/: norms, top_k, attend)."""
    from ladechat.engine.kernels import step_ops

    _kernels_built(step_ops.SOURCE)


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not (SHARED_DATA / "mtbench-dev.jsonl").is_file():
        pytest.skip(f"real prompt sets not found at {SHARED_DATA} (the ../shared/data folder beside the repo)")
    return SHARED_DATA


@pytest.fixture(scope="session")
def embedded_fp32():
    """The embedded SmolLM2 model in fp32 (make test installs it; its absence is a failure), its Linear
    weights packed for oneDNN where that runs (not the default of its 4-bit blocks at 4 bits, whose
    rounded activations tests/test_int4.py and tests/kernels/test_q4.py cover): the fp32 path that must equal HF greedy."""
    from ladechat.engine.load.loading import LoadSpec, load

    return load(LoadSpec(dtype="float32", device="cpu", weights="packed" if _packs_fp32() else "dense"))


def _packs_fp32() -> bool:
    from ladechat.engine.load import packing

    return packing.supported(torch.device("cpu"), torch.float32)


@pytest.fixture()
def isolated_home(tmp_path, monkeypatch):
    """XDG state (history) in a temp dir; the model cache stays shared so the model loads fast."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    monkeypatch.setenv("NO_COLOR", "")
    return tmp_path


def ladechat_bin() -> str:
    exe = REPO / ".venv" / "bin" / "ladechat"
    return str(exe) if exe.exists() else shutil.which("ladechat")


torch.set_num_threads(max(1, torch.get_num_threads()))
