"""Slash commands of the chat: the table that names them (each with its handler, help and
completion; ui/chat.py fills it), parsing and help text (no I/O here)."""

from __future__ import annotations

import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ladechat import settings
from ladechat.errors import UserError


def set_keys_help() -> str:
    """The keys /set takes (settings.set_keys), W, N and G with their meaning, wrapped under /set."""
    named = [settings.LABELS[settings.keys()[k]].lower() if settings.keys()[k] in settings.LABELS else k
             for k in settings.set_keys()]
    return textwrap.fill(", ".join(named), width=100, initial_indent=" " * HELP_WIDTH,
                         subsequent_indent=" " * HELP_WIDTH)


USAGE = """\
Input: Enter sends; Alt+Enter (or Esc then Enter) adds a new line; a message that starts with
\"\"\" continues until a line that ends with \"\"\". Ctrl-C stops an answer or clears the line."""
HELP_WIDTH = 22  # /help's column of descriptions

NULLABLE = {"seed": ("none", "random"), "template": ("none",)}  # what `/set KEY=...` takes for unset


class CommandError(UserError, ValueError):
    pass


@dataclass(frozen=True)
class Entry:
    """One slash command: its name, what it takes, its line of /help, and what runs it."""
    name: str
    args: str
    help: str
    run: Callable[[Any, str], bool | None]  # (the chat, the argument); False leaves the chat
    aliases: tuple[str, ...] = ()
    takes_path: bool = False  # Tab completes its argument as a file's path
    more: str = ""  # lines under its help line, already indented


class Table:
    """The chat's commands, in /help's order: the one place a command is named."""

    def __init__(self, entries: list[Entry]) -> None:
        self.entries = entries
        self._by_name = {name: entry for entry in entries for name in (entry.name, *entry.aliases)}

    def names(self) -> list[str]:
        """Every name a command answers to, for completion."""
        return list(self._by_name)

    def path_names(self) -> set[str]:
        return {name for name, entry in self._by_name.items() if entry.takes_path}

    def find(self, line: str) -> tuple[Entry, str]:
        """The command a line names, and its argument; an unknown name is a CommandError."""
        head, _, rest = line.strip().partition(" ")
        entry = self._by_name.get(head.lower())
        if entry is None:
            raise CommandError(f"unknown command {head} (try /help)")
        return entry, rest.strip()

    def help(self) -> str:
        lines = []
        for entry in self.entries:
            usage = f"{entry.name} {entry.args}".rstrip()
            lines.append(f"{usage:<{HELP_WIDTH - 1}} {entry.help}".rstrip() if len(usage) < HELP_WIDTH
                         else f"{usage} {entry.help}")
            if entry.more:
                lines.append(entry.more)
        paths = ", ".join(entry.name for entry in self.entries if entry.takes_path)
        return "\n".join(lines + [USAGE, f"Tab completes the commands, and a file's path after {paths}."])


def on_off(arg: str, name: str) -> bool:
    if arg.lower() in ("on", "true", "1", "yes"):
        return True
    if arg.lower() in ("off", "false", "0", "no"):
        return False
    raise CommandError(f"usage: {name} on|off")


def answer_format(arg: str) -> str | None:
    """/format's argument as the format setting: json, off (None) or a JSON Schema's file."""
    word = arg.strip()
    if word.lower() == "json":
        return "json"
    if word.lower() in ("off", "text", "none"):
        return None
    if not word:
        raise CommandError("usage: /format json|off|SCHEMA.json")
    from ladechat.ui.files import json_schema

    return json_schema(word)


def parse_set(arg: str) -> dict:
    """'w=7 temperature=0.7' -> {'window': '7', 'temperature': '0.7'}: known keys, values as typed
    (Settings.updated(..., strict=False) converts and checks them); seed=none and template=none unset."""
    keys = ", ".join(settings.set_keys())
    if not arg:
        raise CommandError(f"usage: /set KEY=VALUE ... (keys: {keys})")
    values: dict = {}
    for item in arg.replace(",", " ").split():
        key, eq, raw = item.partition("=")
        name = settings.keys().get(key.lower())
        if not eq or name is None or name in ("stop", "format"):
            raise CommandError(f"cannot set {item!r} (keys: {keys})")
        values[name] = None if raw.lower() in NULLABLE.get(name, ()) else raw
    return values
