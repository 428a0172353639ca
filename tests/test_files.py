"""Files put into a message (/read in the chat, ask -f): the text under its name in a fence, and a
one-line error for whatever cannot go in."""

import os

import pytest

from ladechat.ui.files import MAX_BYTES, FileError, attachment, with_attachments


def test_a_text_file_goes_in_under_its_name_fenced(tmp_path):
    notes = tmp_path / "notes.md"
    notes.write_text("# Plan\n\nuse ``` fences\n\n", encoding="utf-8")
    block = attachment(str(notes))
    assert block == "notes.md:\n````\n# Plan\n\nuse ``` fences\n````"  # a fence longer than any inside
    assert with_attachments([block], "Summarise it.") == block + "\n\nSummarise it."
    assert with_attachments([block, block], "  ") == block + "\n\n" + block


@pytest.mark.parametrize("make,message", [
    (lambda d: d / "missing.txt", "no such file: {}"),
    (lambda d: d, "{} is a folder, not a file"),
    (lambda d: (d / "b.bin").write_bytes(b"\x7fELF\x00\x01") and d / "b.bin", "{} looks binary (it contains NUL bytes)"),
    (lambda d: (d / "l.txt").write_bytes("café".encode("latin-1")) and d / "l.txt", "{} is not UTF-8 text"),
])
def test_what_cannot_go_in_is_one_line(tmp_path, make, message):
    path = make(tmp_path)
    with pytest.raises(FileError) as caught:
        attachment(str(path))
    assert str(caught.value).startswith(message.format(path)) and "\n" not in str(caught.value)


def test_a_file_past_any_context_is_refused_and_read_no_further(tmp_path):
    big = tmp_path / "big.log"
    with open(big, "wb") as fh:
        fh.truncate(4 * MAX_BYTES)  # sparse: no bytes written
    with pytest.raises(FileError, match="larger than 4 MiB, too large for a message"):
        attachment(str(big))


def test_a_device_or_a_pipe_is_refused_not_read_forever(tmp_path):
    with pytest.raises(FileError, match="/dev/zero is not a regular file"):
        attachment("/dev/zero")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(FileError, match="is not a regular file"):
        attachment(str(fifo))


def test_the_clipboard_request_and_the_editor(monkeypatch, tmp_path):
    import base64

    from ladechat.ui import outside

    sequence = outside.osc52("héllo\nworld")
    assert sequence.startswith("\x1b]52;c;") and sequence.endswith("\x07")
    assert base64.b64decode(sequence[7:-1]).decode("utf-8") == "héllo\nworld"
    monkeypatch.setenv("VISUAL", "code -w")
    assert outside.editor_command() == ["code", "-w"]
    monkeypatch.delenv("VISUAL")
    monkeypatch.setenv("EDITOR", str(tmp_path / "no-such-editor"))
    with pytest.raises(outside.OutsideError, match="cannot start the editor .*no-such-editor.*set VISUAL or EDITOR"):
        outside.edit("draft")
    script = tmp_path / "upper.sh"
    script.write_text('#!/bin/sh\ntr a-z A-Z < "$1" > "$1.new" && mv "$1.new" "$1"\n')
    script.chmod(0o755)
    monkeypatch.setenv("EDITOR", str(script))
    assert outside.edit("draft\n") == "DRAFT"
