"""GGUFs from the hub as users name them (engine/load/hub.py), against a local server playing the
hub (tests/fake_hub.py, through HF_ENDPOINT): a download checked and run as a local GGUF, one
killed midway and resumed, a wrong checksum refused and removed, a file in parts joined, a repo
without that quantization, gated, offline; `ladechat pull`, `models` and `rm`."""

import hashlib
import os
import signal
import subprocess
import time

import pytest
from conftest import ladechat_bin
from fake_hub import FakeHub, split_gguf
from gguf import GGUFReader

from ladechat.engine.load import hub
from ladechat.engine.load.gguf.files import embedded_gguf

REPO = "someone/SmolLM2-135M-Instruct-GGUF"
FILE = "SmolLM2-135M-Instruct-Q4_1.gguf"


@pytest.fixture
def fake_hub(tmp_path, monkeypatch):
    served = FakeHub()
    env = {"HF_ENDPOINT": served.url, "HF_HOME": str(tmp_path / "hf"), "XDG_CACHE_HOME": str(tmp_path / "cache")}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", served.url)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    served.env = {**os.environ, **env}
    yield served
    served.close()


def run(hub_env: dict, *args, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([ladechat_bin(), *args], capture_output=True, text=True, env=hub_env, timeout=timeout, check=False)


def test_a_hub_gguf_is_downloaded_checked_and_found_again_offline(fake_hub, monkeypatch):
    data = embedded_gguf().read_bytes()
    fake_hub.add(REPO, {FILE: data, "SmolLM2-135M-Instruct-Q8_0.gguf": b"other", "README.md": b"# hi"})
    path = hub.fetch(*hub.gguf_ref(f"hf.co/{REPO}:Q4_1"))
    assert path.name == FILE and hashlib.sha256(path.read_bytes()).digest() == hashlib.sha256(data).digest()
    with pytest.raises(hub.HubError, match=r"has no Q4_K_M GGUF \(it has: Q4_1, Q8_0\)"):
        hub.fetch(REPO, "Q4_K_M")  # hf.co/REPO alone asks for Q4_K_M
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    asked = len(fake_hub.requests)
    assert hub.fetch(REPO, "q4_1", refresh=True) == path and len(fake_hub.requests) == asked  # the cache, no request
    with pytest.raises(hub.HubError, match=r"Q8_0 is not downloaded, and offline"):
        hub.fetch(REPO, "Q8_0")
    from ladechat.engine.load.readers import locate

    folder, name, gguf = locate(f"hf.co/{REPO}:Q4_1", None)  # then run as any local GGUF
    assert gguf == path and name == f"{REPO}:Q4_1" and (hub.Path(folder) / "config.json").is_file()
    removed = hub.remove(REPO, "q4_1")  # the file and what its load kept beside it
    assert path in removed and hub.Path(folder) in removed and not path.exists() and not hub.Path(folder).exists()


def test_refusals_are_one_line(fake_hub):
    fake_hub.add(REPO, {FILE: b"GGUF" + bytes(100)})
    fake_hub.gated.add("meta/gated-GGUF")
    fake_hub.repos["meta/gated-GGUF"] = {}
    for model, words in ((f"hf.co/{REPO}:IQ2_XS", "has no IQ2_XS GGUF (it has: Q4_1)"),
                         ("hf.co/meta/gated-GGUF", "is gated: accept its terms on huggingface.co"),
                         ("hf.co/nobody/nothing", "no model nobody/nothing on the hub")):
        r = run(fake_hub.env, "ask", "--model", model, "hi")
        assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
        assert r.stderr.strip().splitlines()[-1].startswith("ladechat: error:") and words in r.stderr, r.stderr


def test_a_file_that_fails_its_checksum_is_removed_and_never_run(fake_hub):
    fake_hub.add(REPO, {FILE: embedded_gguf().read_bytes()})
    fake_hub.lying.add((REPO, FILE))
    r = run(fake_hub.env, "ask", "--model", f"{REPO}:Q4_1", "hi")
    assert r.returncode == 1 and "does not match the hub's checksum" in r.stderr, r.stderr
    left = [p.name for p in hub.hub_folder().rglob("*")]
    assert not [n for n in left if n.endswith((".gguf", ".partial"))], left  # neither the file nor a part of it


def test_a_download_killed_midway_goes_on_where_it_stopped(fake_hub):
    data = os.urandom(8 << 20)
    fake_hub.add(REPO, {FILE: data})
    fake_hub.hold_after[(REPO, FILE)] = 3 << 20  # 3 MiB, then the connection hangs until the test is done
    puller = subprocess.Popen([ladechat_bin(), "pull", f"hf.co/{REPO}:Q4_1"], env=fake_hub.env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    partial = hub.local_path(REPO, FILE + ".partial")
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (partial.is_file() and partial.stat().st_size >= 1 << 20):
        time.sleep(0.02)
    puller.send_signal(signal.SIGINT)  # Ctrl-C
    assert puller.wait(60) == 130
    fake_hub.released.set()
    kept = partial.stat().st_size
    assert kept >= 1 << 20
    r = run(fake_hub.env, "pull", f"hf.co/{REPO}:Q4_1")
    assert r.returncode == 0, r.stderr
    assert fake_hub.ranges[-1] == f"bytes={kept}-"  # asked for the rest only
    path = hub.local_path(REPO, FILE)
    assert path.read_bytes() == data and not partial.exists()
    listed = run(fake_hub.env, "models")
    assert listed.returncode == 0 and listed.stdout == f"hf.co/{REPO}:Q4_1\t0.01 GB\t{path}\n", listed
    removed = run(fake_hub.env, "rm", f"{REPO}:Q4_1")
    assert removed.returncode == 0 and not path.exists(), removed.stderr
    assert run(fake_hub.env, "models").stdout == ""
    again = run(fake_hub.env, "rm", f"{REPO}:Q4_1")
    assert again.returncode == 1 and "is not downloaded" in again.stderr


def test_a_server_that_ignores_the_range_gives_the_whole_file_again(fake_hub):
    data = os.urandom(3 << 20)
    fake_hub.add(REPO, {FILE: data})
    partial = hub.local_path(REPO, FILE + ".partial")
    partial.parent.mkdir(parents=True)
    partial.write_bytes(data[:1 << 20])  # an earlier try's part, of this very file
    hub.local_path(REPO, FILE + ".partial.sha256").write_text(hashlib.sha256(data).hexdigest())
    fake_hub.no_ranges = True
    assert hub.fetch(REPO, "Q4_1").read_bytes() == data and fake_hub.ranges == [f"bytes={1 << 20}-"]
    other = os.urandom(2 << 20)  # a part of another version of the file: not asked to go on
    fake_hub.add(REPO, {FILE: other})
    fake_hub.no_ranges = False
    hub.local_path(REPO, FILE).rename(partial)
    assert hub.fetch(REPO, "Q4_1", refresh=True).read_bytes() == other and fake_hub.ranges[-1] == ""


def test_a_gguf_in_parts_is_joined_into_one(fake_hub, tmp_path):
    source = embedded_gguf()
    split_gguf(source, tmp_path / "a.gguf", tmp_path / "b.gguf")
    fake_hub.add(REPO, {"Q4_1/SmolLM2-Q4_1-00001-of-00002.gguf": (tmp_path / "a.gguf").read_bytes(),
                        "Q4_1/SmolLM2-Q4_1-00002-of-00002.gguf": (tmp_path / "b.gguf").read_bytes()})
    joined = GGUFReader(hub.fetch(REPO, "Q4_1"))
    original = GGUFReader(source)
    assert [t.name for t in joined.tensors] == [t.name for t in original.tensors]
    for mine, theirs in zip(joined.tensors, original.tensors):
        assert mine.tensor_type == theirs.tensor_type and list(mine.shape) == list(theirs.shape)
        assert bytes(mine.data) == bytes(theirs.data)
    assert not any(name.startswith("split.") for name in joined.fields)
    for name in original.fields:
        if not name.startswith("GGUF."):
            assert joined.fields[name].contents() == original.fields[name].contents(), name
