"""Files put into a message (`/read PATH` in the chat, `ladechat ask -f PATH`): the text of each,
under its name, fenced so the model sees where it begins and ends."""

from __future__ import annotations

from pathlib import Path

from ladechat.errors import UserError
from ladechat.paths import Unreadable, read_bounded

MAX_BYTES = 4 * 1024 * 1024  # far past any context: a larger file is a mistake, not a document


class FileError(UserError):
    """A file that cannot go into a message; one line, nothing sent."""


def read_text(path: str) -> tuple[str, str]:
    """(its name, its text): FileError for a missing file, a folder, a device or pipe, an unreadable,
    binary or oversized one."""
    file = Path(path).expanduser()
    try:
        data = read_bounded(file, MAX_BYTES)
    except Unreadable as why:
        words = {"missing": f"no such file: {path}", "folder": f"{path} is a folder, not a file",
                 "special": f"{path} is not a regular file", "denied": f"cannot read {path}: permission denied",
                 "too large": f"{path} is larger than {MAX_BYTES // 2**20} MiB, too large for a message"}
        raise FileError(words.get(why.kind, f"cannot read {path}: {why.detail}")) from None
    if b"\x00" in data:
        raise FileError(f"{path} looks binary (it contains NUL bytes); only text files go into a message")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise FileError(f"{path} is not UTF-8 text; only text files go into a message") from None
    return file.name, text


def attachment(path: str) -> str:
    """The file as it goes into a message: its name, then its text in a fence longer than any
    run of backticks inside it."""
    name, text = read_text(path)
    fence = "```"
    while fence in text:
        fence += "`"
    return f"{name}:\n{fence}\n{text.rstrip(chr(10))}\n{fence}"


def with_attachments(attached: list[str], text: str) -> str:
    return "\n\n".join([*attached, text] if text.strip() else attached)


def json_schema(source: str) -> str:
    """A JSON Schema given as its JSON text or as a file holding it, as compact JSON text (the
    format setting's value): FileError, one line, for a file that cannot be read or text that is
    not a JSON object."""
    import json

    text = source
    if not source.lstrip().startswith("{"):
        _, text = read_text(source)
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as exc:
        raise FileError(f"{source if text is not source else 'the schema'} is not valid JSON "
                        f"({exc.msg} at line {exc.lineno})") from None
    if not isinstance(schema, dict):
        raise FileError("a JSON Schema is a JSON object")
    return json.dumps(schema)
