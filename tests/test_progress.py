"""A slow phase's line as it goes (engine/load/progress.py): the sizes a first use shows while it
lays out a GGUF's blocks or reads its weights, and the part of the config and tokenizer it reads,
through the update(text) that ui/phase.py's spinner gives (the step-cost measurement's rounds:
tests/test_cost_envelope.py)."""

import io
from contextlib import contextmanager

from rich.console import Console

from ladechat.engine.load.gguf import quantized
from ladechat.engine.load.progress import sized
from ladechat.ui.phase import phases


def recording(lines: list[str]):
    """progress(message) as the loaders take it, each message and each update appended to lines."""

    @contextmanager
    def progress(message):
        lines.append(message)
        yield lines.append

    return progress


def test_sizes_show_on_the_phase_line():
    lines: list[str] = []
    report = sized(lines.append, "Reading x")
    report(0, 4_100_000_000)
    report(4_100_000_000, 4_100_000_000)  # the end is always shown
    assert lines[0] == "Reading x: 0.00 / 4.10 GB" and lines[-1] == "Reading x: 4.10 / 4.10 GB"
    small = []
    sized(small.append, "Reading y")(88_000_000, 105_000_000)
    assert small == ["Reading y: 88 / 105 MB"]
    assert sized(None, "Reading x") is None  # a phase with nothing to show
    console = Console(file=io.StringIO(), force_terminal=True)
    with phases(console)("Reading x") as update:
        update("Reading x: 1.00 / 4.10 GB")  # the spinner's own line changes


def test_a_first_use_shows_the_blocks_laid_out_so_far(tmp_path):
    from test_int4 import dense_from_gguf, write_tiny_gguf

    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")
    lines: list[str] = []
    progress = recording(lines)

    quantized.apply(dense_from_gguf(gguf), gguf, tmp_path / "kept", None, progress)
    title = "Laying out the quantized blocks of tiny.gguf (one time)"
    sizes = [line for line in lines if line.startswith(title + ": ")]
    assert lines[0] == title and sizes and sizes[0].startswith(title + ": 0 / ") and sizes[0].endswith(" MB")


def test_a_first_use_says_which_part_of_the_config_and_tokenizer_it_reads(tmp_path, monkeypatch):
    import json

    from test_int4 import write_tiny_gguf

    from ladechat.engine.load.gguf import files

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")
    lines: list[str] = []
    progress = recording(lines)

    files.ensure_prepared(gguf, progress)
    title = "Reading the config and tokenizer of tiny.gguf (one time)"
    vocabulary = json.loads((files.prepared_dir(gguf) / "config.json").read_text())["vocab_size"]
    assert lines == [title, f"{title}: the metadata", f"{title}: the tokenizer ({vocabulary:,} tokens)",
                     f"{title}: writing them"]
    files.ensure_prepared(gguf, progress)  # prepared: nothing to read, nothing shown
    assert len(lines) == 4
