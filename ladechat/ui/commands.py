"""Slash commands of the chat: parsing and help text (no I/O here)."""

from __future__ import annotations

import textwrap
from dataclasses import dataclass

from ladechat import settings
from ladechat.errors import UserError


def _set_keys() -> str:
    """The keys /set takes (settings.set_keys), W, N and G with their meaning, wrapped under /set."""
    named = [settings.LABELS[settings.keys()[k]].lower() if settings.keys()[k] in settings.LABELS else k
             for k in settings.set_keys()]
    return textwrap.fill(", ".join(named), width=100, initial_indent=" " * 22, subsequent_indent=" " * 22)


HELP = f"""\
/help                 this list
/lookahead on|off     lookahead decoding on or off (from the next answer)
/store on|off|clear   draft from this model's store of past answers (and add to it); clear: forget them
/set KEY=VALUE ...    change settings, e.g. /set w=3 temperature=0.7 (seed=none: random); keys:
{_set_keys()}
/show                 current settings
/model [NAME|PATH]    the model answering; with a name, id, folder or .gguf: another answers from now on
/stats                session totals per mode: tokens, steps, tokens/step, tok/s
/context              how much of the model's context the conversation holds (--ctx sets it)
/thinking             the last answer's reasoning (<think>...</think>), folded to one line once the answer ends
/debug on|off         per-step acceptance and a per-turn statistics panel
/markdown on|off      redraw finished answers with code blocks, lists or headings as Markdown
/read PATH [TEXT]     put a text file into the next message, or with TEXT into this one (Tab completes paths)
/edit [TEXT]          write the message in $VISUAL or $EDITOR (Ctrl-X Ctrl-E too); it is sent when the editor closes
/copy                 the last answer onto the clipboard (through the terminal: OSC 52)
/system TEXT          set the system prompt (empty: remove it); starts a new conversation
/clear                start a new conversation (settings are kept)
/undo                 drop the last question and its answer
/retry                answer the last question again
/save PATH            save the conversation and settings as JSON
/load PATH            load a conversation saved with /save
/history [N]          the chats kept so far (newest first); /history N opens chat N (ladechat --continue: the last)
/exit                 leave (Ctrl-D works too)
Input: Enter sends; Alt+Enter (or Esc then Enter) adds a new line; a message that starts with
\"\"\" continues until a line that ends with \"\"\". Ctrl-C stops an answer or clears the line."""

COMMANDS = ("/help", "/lookahead", "/store", "/set", "/show", "/model", "/stats", "/context", "/thinking", "/read", "/edit", "/copy", "/debug", "/markdown", "/system", "/clear",
            "/undo", "/retry", "/save", "/load", "/history", "/exit", "/quit")

NULLABLE = {"seed": ("none", "random"), "template": ("none",)}  # what `/set KEY=...` takes for unset


class CommandError(UserError, ValueError):
    pass


@dataclass(frozen=True)
class Command:
    name: str
    arg: str


def parse(line: str) -> Command:
    head, _, rest = line.strip().partition(" ")
    name = head.lower()
    if name not in COMMANDS:
        raise CommandError(f"unknown command {head} (try /help)")
    return Command(name="/exit" if name == "/quit" else name, arg=rest.strip())


def on_off(arg: str, name: str) -> bool:
    if arg.lower() in ("on", "true", "1", "yes"):
        return True
    if arg.lower() in ("off", "false", "0", "no"):
        return False
    raise CommandError(f"usage: {name} on|off")


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
        if not eq or name is None or name == "stop":
            raise CommandError(f"cannot set {item!r} (keys: {keys})")
        values[name] = None if raw.lower() in NULLABLE.get(name, ()) else raw
    return values
