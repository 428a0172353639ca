"""The interactive chat: prompt-toolkit input, streamed answers, slash commands."""

from __future__ import annotations

import asyncio
import shlex
import signal
import sys
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.text import Text

from ladechat.backends.base import Backend, interrupt
from ladechat.backends.pending import LoadFailed, PendingBot
from ladechat.conversation import Conversation, ConversationError
from ladechat.engine.events import Done, Stats
from ladechat.errors import UserError
from ladechat.paths import state_root
from ladechat.settings import Settings, group, key, keys
from ladechat.ui import commands, outside
from ladechat.ui.files import attachment, with_attachments
from ladechat.ui.history import ChatLog, find_chat, list_chats
from ladechat.ui.phase import phases
from ladechat.ui.stream import StreamPrinter, context_line, debug_panel, failure, footer, nearly_full


class Totals:
    """Session totals per mode (lookahead on / off)."""

    def __init__(self) -> None:
        self.by_mode: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))

    def add(self, stats: Stats) -> None:
        row = self.by_mode["lookahead" if stats.lookahead else "plain"]
        row["turns"] += 1
        row["tokens"] += stats.new_tokens
        row["steps"] += stats.steps
        row["seconds"] += stats.decode_s

    def lines(self) -> list[str]:
        if not self.by_mode:
            return ["no answers yet"]
        out = []
        for mode, r in sorted(self.by_mode.items()):
            tps = r["tokens"] / r["seconds"] if r["seconds"] else 0.0
            comp = r["tokens"] / r["steps"] if r["steps"] else 0.0
            out.append(f"{mode}: {int(r['turns'])} answers, {int(r['tokens'])} tokens, {int(r['steps'])} steps, "
                       f"{comp:.2f} tokens/step, {tps:.1f} tok/s")
        return out


class ChatApp:
    def __init__(self, bot: Backend, system: str | None, debug: bool, out: Console, err: Console,
                 markdown: bool = True, hide_thinking: bool = False, log: ChatLog | None = None,
                 switch: Callable[[str], Backend] | None = None) -> None:
        """log: where the chat is kept as it goes (None: --no-history); switch(name): another
        model's bot, opened as this one was (/model; UserError when it cannot be)."""
        self.bot = bot
        self.switch = switch
        self.conversation = Conversation(system=system)
        self.debug = debug
        self.markdown = markdown
        self.hide_thinking = hide_thinking
        self.out = out
        self.err = err
        self.totals = Totals()
        self.last_stats: Stats | None = None  # of this conversation's last answer (/context)
        self.last_thinking = ""  # the last answer's <think> text (/thinking), never in the conversation
        self.attached: list[str] = []  # files read with /read, for the next message
        self.log = log
        self.pending_settings: dict | None = None  # a reopened chat's, put in once the model has loaded
        self.template_before_raw: str | None = None  # the template /raw on replaced, put back by /raw off

    # -- answering ----------------------------------------------------------------------------
    def answer(self) -> None:
        if isinstance(self.bot, PendingBot):
            try:
                self.bot.bot()  # wait for the model, with a spinner (LoadFailed ends the chat)
            except KeyboardInterrupt:
                self.conversation.messages.append({"role": "assistant", "content": "", "interrupted": True})
                self.err.print("[yellow]interrupted while the model loads (it goes on loading; /retry answers)[/]")
                return
        self._settings()
        printer = StreamPrinter(self.out, self.err, debug=self.debug, markdown=self.markdown,
                                hide_thinking=self.hide_thinking)
        events = self.bot.reply(self.conversation)
        stats = None
        failed = None
        try:
            for event in events:
                if isinstance(event, Done):
                    stats = event.stats
                else:
                    printer.handle(event)
        except KeyboardInterrupt:  # while an event was printed: the stream ends as if it had landed there
            if stats is None and (done := interrupt(events)) is not None:
                stats = done.stats
            events.close()
        except Exception as exc:
            # First the backend's own failures (out of memory, a server gone or failing: backends.base.RemoteError
            # is a UserError too), then the user's (e.g. the question alone does not fit the context).
            failed = failure(exc)
            if failed is None:
                if not isinstance(exc, UserError):
                    raise
                self.conversation.messages.pop()
                self.error(str(exc))
                return
            if not printer.text:
                if getattr(exc, "retry", False):  # the server is gone or failed: the question waits for it
                    self.conversation.messages.append({"role": "assistant", "content": "", "interrupted": True})
                    self.error(f"{failed} (the question was not answered; /retry asks it again, Up recalls it)")
                else:
                    self.conversation.messages.pop()
                    self.error(f"{failed} (the question was not answered; Up recalls it)")
                return
        interrupted = stats is None or stats.finish_reason == "interrupted"
        self.conversation.messages.append({"role": "assistant", "content": printer.text,
                                           "interrupted": interrupted})
        self.last_thinking = printer.thinking.strip("\n")
        printer.finish(complete=not interrupted)
        if stats is not None:
            if self.bot.stats_reported:
                self.totals.add(stats)
            if self.debug:
                self.err.print(debug_panel(stats))
            self.err.print(f"[dim]{escape(footer(stats, self.bot))}[/]", highlight=False, soft_wrap=True)
            self.last_stats = stats
            if (full := nearly_full(stats)) is not None:
                self.err.print(f"[yellow]{escape(full)}[/]", highlight=False)
        if failed:
            self.error(f"{failed} (the partial answer is kept; /retry answers again)")
        elif interrupted and printer.text:
            self.err.print("[yellow]interrupted: the partial answer is kept[/]")
        elif interrupted:
            self.err.print("[yellow]interrupted before the answer began (/retry answers again)[/]")

    def ask(self, text: str) -> None:
        text, self.attached = with_attachments(self.attached, text), []
        self.conversation.messages.append({"role": "user", "content": text})
        self.keep()  # the question is kept before the answer begins: a crash mid-answer loses nothing
        try:
            self.answer()
        finally:
            self.keep()

    # -- the chat kept as it goes -------------------------------------------------------------
    def keep(self) -> None:
        """Write the conversation to its chat file (history.py), if the chat is kept."""
        if self.log is None:
            return
        model = self.bot.name if self.bot.ready else getattr(self.bot, "label", "?")
        settled = self.bot.ready and self.pending_settings is None  # else the file's settings stay
        failed = self.log.keep(self.conversation, model, self.bot.settings.as_dict() if settled else None)
        if failed is not None:
            self.error(f"this chat is not being kept ({failed}); /save still works")

    def reopen(self, path: Path) -> None:
        """Make the kept chat at `path` the conversation (its settings too, once the model has
        loaded), and write on to its file; the last few messages are shown again."""
        conversation, saved = Conversation.from_file(path)
        known = {key: value for key, value in saved.items() if key in keys()}
        try:
            Settings().updated(known)  # a bad value is refused before anything changes
        except UserError as exc:
            raise ConversationError(f"{path} has bad settings: {exc}") from None
        self._start_over(conversation.system)
        self.conversation = conversation
        self.pending_settings = known
        if self.log is not None and (moved := self.log.open(path, saved)) is not None:
            self.info(moved)
        if self.bot.ready:
            self._settings()
        self._recap(path)

    def _recap(self, path: Path, shown: int = 4) -> None:
        messages = self.conversation.messages
        earlier = len(messages) - shown
        self.info(f"reopened chat {path.stem}: {len(messages)} messages"
                  + (f", the last {shown} below" if earlier > 0 else ""))
        for message in messages[max(0, earlier):]:
            if message["role"] == "user":
                self.err.print(f">>> {message['content']}", highlight=False, markup=False, soft_wrap=True)
            else:
                self.out.print(message["content"], highlight=False, markup=False, soft_wrap=True)
        if messages and messages[-1]["role"] == "user":
            self.info("the last question has no answer yet: /retry answers it")

    def _history(self, arg: str) -> None:
        """/history: the kept chats; /history N|ID: open one (this one is kept as it is)."""
        if self.log is None:
            raise commands.CommandError("chats are not kept in this session (--no-history)")
        if arg:
            self.keep()
            self.reopen(find_chat(self.log.root, arg))
            return
        chats = list_chats(self.log.root)
        if not chats:
            self.info("no chats kept yet")
            return
        shown = chats[:HISTORY_SHOWN]
        lines = [chat.line(number) + ("  (this chat)" if chat.path == self.log.path else "")
                 for number, chat in enumerate(shown, 1)]
        more = f"\n... {len(chats) - len(shown)} older (ladechat history lists them all)" if len(chats) > len(shown) else ""
        self.info("\n".join(lines) + more + "\n/history N opens chat N")

    def _settings(self) -> Settings:
        """The bot's settings, a reopened chat's put in first (they wait for the model)."""
        if self.pending_settings is not None:
            known, self.pending_settings = self.pending_settings, None
            try:
                self._configure(self.bot.settings.updated(known))
            except UserError as exc:
                self.error(f"the chat's saved settings were not applied: {exc}")
        return self.bot.settings

    def _read(self, arg: str) -> None:
        """/read PATH [QUESTION]: the file into the next message, or with QUESTION into this one."""
        lexer = shlex.shlex(arg, posix=True)
        lexer.whitespace_split = True
        lexer.commenters = ""  # a '#' in a file name is part of it
        try:
            path = lexer.get_token()  # a path with spaces in quotes, as a shell takes it
        except ValueError as exc:
            raise commands.CommandError(f"/read: {exc}") from None
        if not path:
            raise commands.CommandError("/read needs a file: /read PATH [question]")
        question = lexer.instream.read().strip()
        self.attached.append(attachment(path))
        if question:
            self.ask(question)
            return
        count = len(self.attached)
        self.info(f"read {Path(path).name} ({len(self.attached[-1]):,} characters): it goes with your next message"
                  + (f" ({count} files)" if count > 1 else ""))

    def interrupted_outside_stream(self) -> None:
        """Ctrl-C landed in a command or just before/after an answer's stream. The conversation
        and the settings are each replaced whole and /save writes a temp file first; what can be
        left half-done is a question without its answer (it gets an empty interrupted one, as
        /retry expects) and the decoder's settings lagging the bot's (set again)."""
        msgs = self.conversation.messages
        if msgs and msgs[-1]["role"] == "user":
            msgs.append({"role": "assistant", "content": "", "interrupted": True})
        if self.bot.ready:  # else Ctrl-C stopped the wait for the model: nothing was configured
            self.bot.configure(self.bot.settings)
        self.keep()
        self.err.print("[yellow]interrupted[/]")

    # -- commands -----------------------------------------------------------------------------
    def error(self, message: str) -> None:
        self.err.print(f"error: {message}", style="red", highlight=False, markup=False)

    def info(self, message: str) -> None:
        self.err.print(message, highlight=False, markup=False)

    def command(self, line: str) -> bool:
        """Run a slash command; False means leave the chat. The chat is kept after it (a command
        may change the conversation or its settings)."""
        try:
            entry, arg = COMMANDS.find(line)
            return entry.run(self, arg) is not False
        except UserError as exc:
            self.error(str(exc))
        except OSError as exc:
            self.error(f"{exc.strerror or exc}: {exc.filename or ''}".rstrip(": "))
        finally:
            self.keep()
        return True

    # -- the commands (COMMANDS below names them) -----------------------------------------------
    def _help(self, arg: str) -> None:
        self.info(COMMANDS.help())

    def _lookahead(self, arg: str) -> None:
        self._configure(self._settings().updated({"lookahead": commands.on_off(arg, "/lookahead")}))
        self.info(f"lookahead {'on' if self.bot.settings.lookahead else 'off'} from the next answer")

    def _format(self, arg: str) -> None:
        answer_format = commands.answer_format(arg)
        self._configure(self._settings().updated({"format": answer_format}))
        self.info("answers are free text from the next one" if answer_format is None else
                  "each answer is one JSON object from the next one" if answer_format == "json" else
                  f"each answer is one JSON document of the schema in {arg.strip()} from the next one")

    def _raw(self, arg: str) -> None:
        """/raw on: no chat format, the conversation's text continued as written; off: the template
        the chat had before (the model's own by default)."""
        from ladechat.templates import RAW

        settings = self._settings()
        if commands.on_off(arg, "/raw"):
            if settings.template != RAW:
                self.template_before_raw = settings.template
            self._configure(settings.updated({"template": RAW}))
            self.info("answers continue the conversation's text as written (no chat format) from the next one")
            return
        if settings.template != RAW:
            self.info("answers are in the chat format already (/raw on: the text continued as written)")
            return
        before, self.template_before_raw = self.template_before_raw, None
        self._configure(settings.updated({"template": before}))
        self.info(f"answers in the {before + ' template' if before else 'model'}'s chat format from the next one (a "
                  "model without a chat template goes on continuing the text: /set template=NAME gives it one)")

    def _set(self, arg: str) -> None:
        self._configure(self._settings().updated(commands.parse_set(arg), strict=False))
        self.info(self._show())

    def _print_settings(self, arg: str) -> None:
        self.info(self._show())

    def _stats(self, arg: str) -> None:
        self._need_stats("/stats")
        self.info("\n".join(self.totals.lines()))

    def _context(self, arg: str) -> None:
        self.info(context_line(self.last_stats))

    def _thinking(self, arg: str) -> None:
        if not self.last_thinking:
            raise commands.CommandError("the last answer had no thinking (<think>...</think>) to show")
        self.out.print(Text(self.last_thinking, style="dim"), highlight=False, soft_wrap=True)

    def _debug(self, arg: str) -> None:
        if commands.on_off(arg, "/debug"):
            self._need_stats("/debug")
        self.debug = commands.on_off(arg, "/debug")
        self.info(f"debug {'on' if self.debug else 'off'}")

    def _markdown(self, arg: str) -> None:
        self.markdown = commands.on_off(arg, "/markdown")
        self.info(f"markdown rendering of finished answers {'on' if self.markdown else 'off'}")

    def _edit(self, arg: str) -> None:
        text = outside.edit(arg)
        if not text:
            self.info("the editor left the message empty: nothing sent")
        else:
            self.ask(text)

    def _system(self, arg: str) -> None:
        self._start_over(arg or None)
        self.info("system prompt set; new conversation" if arg else "system prompt removed; new conversation")

    def _clear(self, arg: str) -> None:
        self._start_over(self.conversation.system)
        self.info("new conversation")

    def _undo(self, arg: str) -> None:
        self._undo_or_retry("/undo")

    def _retry(self, arg: str) -> None:
        self._undo_or_retry("/retry")

    def _exit(self, arg: str) -> bool:
        return False

    def _model(self, name: str) -> None:
        """/model: the model answering; /model NAME|PATH: another one answers from now on, the
        conversation going on in its template. A model that cannot be opened leaves this one."""
        if not name:
            self.info(f"model {self.bot.describe()} (/model NAME|PATH answers with another)")
            return
        if self.switch is None:
            raise commands.CommandError("/model: this chat cannot open another model")
        try:
            bot = self.switch(name)
            if isinstance(bot, PendingBot):  # loaded now: one that fails leaves this one answering, the chat on
                bot = bot.bot()
        except (UserError, MemoryError, LoadFailed) as exc:
            why = "not enough memory to load it" if isinstance(exc, MemoryError) else str(exc)
            raise commands.CommandError(f"/model {name}: {why}; the chat goes on with {self.bot.describe()}") from None
        self.bot, self.last_stats = bot, None  # the old model goes with its last reference
        self.info(f"now answering with {bot.describe()}; the conversation ({len(self.conversation.messages)} "
                  "messages) goes on in its template, with the command line's settings")

    def _store(self, arg: str) -> None:
        if arg.lower() == "clear":
            forgotten = self.bot.clear_store()
            self.info(f"store cleared: {forgotten} past answer{'s' if forgotten != 1 else ''} forgotten")
            return
        try:
            on = commands.on_off(arg, "/store")
        except commands.CommandError:
            raise commands.CommandError("usage: /store on|off|clear") from None
        self._configure(self._settings().updated({"store": on}))
        self.info(f"store of past answers {'on' if on else 'off'} from the next answer")

    def _need_stats(self, name: str) -> None:
        if not self.bot.stats_reported:
            raise commands.CommandError(f"{name}: {self.bot.describe()} reports no decoding statistics")

    def _configure(self, settings: Settings) -> None:
        self.bot.configure(settings)
        if self.bot.compiled:
            with phases(self.err)("compiling the decoding steps for these settings"):
                self.bot.warm_up()

    def _show(self) -> str:
        values = self._settings().as_dict()
        lookahead = " ".join(f"{key(k)}={values.pop(key(k))}" for k in group("lookahead") if k != "lookahead")
        enabled = values.pop("lookahead")
        store = values.pop("store")
        answer_format = values.pop("format")
        if answer_format is not None and answer_format != "json":
            values["format"] = f"a JSON schema ({len(answer_format)} characters)"
        elif answer_format == "json":
            values["format"] = "json"
        return (f"model {self.bot.describe()}\n"
                f"lookahead {'on' if enabled else 'off'}: {lookahead}; store of past answers {'on' if store else 'off'}\n"
                + " ".join(f"{k}={v}" for k, v in values.items())
                + f"\nsystem prompt: {self.conversation.system!r}")

    def _undo_or_retry(self, name: str) -> None:
        # A loaded file need not alternate user/assistant (e.g. only an assistant message), so look
        # before dropping anything.
        msgs = self.conversation.messages
        answer = int(bool(msgs) and msgs[-1]["role"] == "assistant")
        question = int(len(msgs) > answer and msgs[-1 - answer]["role"] == "user")
        if name == "/undo":
            if not msgs:
                raise commands.CommandError("nothing to undo")
            del msgs[len(msgs) - answer - question:]
            self.info({(1, 1): "dropped the last question and its answer", (0, 1): "dropped the last answer",
                       (1, 0): "dropped the last question"}[question, answer])
        else:
            if not question:
                raise commands.CommandError("nothing to retry: there is no question to answer again")
            if answer:
                msgs.pop()
            self.answer()

    def _start_over(self, system: str | None) -> None:
        """A new conversation: what belonged to the old one (its last answer's figures, files read
        for its next message) goes with it."""
        self.last_stats, self.attached, self.last_thinking = None, [], ""
        self.conversation = Conversation(system=system)
        if self.log is not None:
            self.log.start_over()

    def _copy(self, arg: str = "") -> None:
        """/copy: the last answer onto the clipboard, through the terminal (OSC 52)."""
        answers = [m["content"] for m in self.conversation.messages if m["role"] == "assistant" and m["content"]]
        if not answers:
            raise commands.CommandError("no answer to copy yet")
        if not self.out.is_terminal:
            raise commands.CommandError("the chat's output is not a terminal, so no clipboard can be reached: nothing copied")
        self.out.file.write(outside.osc52(answers[-1]))
        self.out.file.flush()
        self.info(f"copied the last answer ({len(answers[-1]):,} characters) through the terminal (OSC 52; "
                  "a terminal without it ignores the request)")

    def _save(self, arg: str) -> None:
        if not arg:
            raise commands.CommandError("usage: /save PATH")
        path = Path(arg).expanduser()
        data = self.conversation.to_json(self.bot.name, self._settings().as_dict())
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(data + "\n", encoding="utf-8")
        tmp.replace(path)
        self.info(f"saved {len(self.conversation.transcript())} messages to {path}")

    def _load(self, arg: str) -> None:
        if not arg:
            raise commands.CommandError("usage: /load PATH")
        conversation, saved = Conversation.from_file(Path(arg).expanduser())
        known = {key: value for key, value in saved.items() if key in keys()}  # a newer file's extras: ignored
        try:
            self._configure(self._settings().updated(known))  # a bad template is refused now
        except UserError as exc:
            raise ConversationError(f"{arg} has bad settings: {exc}") from None
        self._start_over(conversation.system)  # a chat file of its own
        self.conversation = conversation
        self.info(f"loaded {len(conversation.messages)} messages from {arg}")


Entry = commands.Entry
COMMANDS = commands.Table([
    Entry("/help", "", "this list", ChatApp._help),
    Entry("/lookahead", "on|off", "lookahead decoding on or off (from the next answer)", ChatApp._lookahead),
    Entry("/store", "on|off|clear", "draft from this model's store of past answers (and add to it); clear: forget them",
          ChatApp._store),
    Entry("/set", "KEY=VALUE ...", "change settings, e.g. /set w=3 temperature=0.7 (seed=none: random); keys:",
          ChatApp._set, more=commands.set_keys_help()),
    Entry("/format", "json|off|SCHEMA.json", "answers as one JSON object (json), one of a JSON schema (its file) or "
          "free text (off), from the next answer", ChatApp._format, takes_path=True),
    Entry("/raw", "on|off", "no chat format: answers continue the conversation's text as written (a base model's "
          "way, and the default for a model without a chat template), or back to the chat format", ChatApp._raw),
    Entry("/show", "", "current settings", ChatApp._print_settings),
    Entry("/model", "[NAME|PATH]", "the model answering; with a name, id, folder or .gguf: another answers from now on",
          ChatApp._model, takes_path=True),
    Entry("/stats", "", "session totals per mode: tokens, steps, tokens/step, tok/s", ChatApp._stats),
    Entry("/context", "", "how much of the model's context the conversation holds (--ctx sets it)", ChatApp._context),
    Entry("/thinking", "", "the last answer's reasoning (<think>...</think>), folded to one line once the answer ends",
          ChatApp._thinking),
    Entry("/debug", "on|off", "per-step acceptance and a per-turn statistics panel", ChatApp._debug),
    Entry("/markdown", "on|off", "redraw finished answers with code blocks, lists or headings as Markdown",
          ChatApp._markdown),
    Entry("/read", "PATH [TEXT]", "put a text file into the next message, or with TEXT into this one (Tab completes paths)",
          ChatApp._read, takes_path=True),
    Entry("/edit", "[TEXT]", "write the message in $VISUAL or $EDITOR (Ctrl-X Ctrl-E too); it is sent when the editor "
          "closes", ChatApp._edit),
    Entry("/copy", "", "the last answer onto the clipboard (through the terminal: OSC 52)", ChatApp._copy),
    Entry("/system", "TEXT", "set the system prompt (empty: remove it); starts a new conversation", ChatApp._system),
    Entry("/clear", "", "start a new conversation (settings are kept)", ChatApp._clear),
    Entry("/undo", "", "drop the last question and its answer", ChatApp._undo),
    Entry("/retry", "", "answer the last question again", ChatApp._retry),
    Entry("/save", "PATH", "save the conversation and settings as JSON", ChatApp._save, takes_path=True),
    Entry("/load", "PATH", "load a conversation saved with /save", ChatApp._load, takes_path=True),
    Entry("/history", "[N]", "the chats kept so far (newest first); /history N opens chat N (ladechat --continue: "
          "the last)", ChatApp._history),
    Entry("/exit", "", "leave (Ctrl-D works too)", ChatApp._exit, aliases=("/quit",)),
])


HISTORY_SHOWN = 20  # kept chats /history lists


def _chat_completer(commands_completer):
    """The commands' names, and the paths of files after a command that takes one."""
    from prompt_toolkit.completion import Completer, PathCompleter
    from prompt_toolkit.document import Document

    paths = PathCompleter(expanduser=True)
    takes_path = COMMANDS.path_names()

    class ChatCompleter(Completer):
        def get_completions(self, document, complete_event):
            before = document.text_before_cursor
            command, _, typed = before.partition(" ")
            if command in takes_path and _ and " " not in typed:
                yield from paths.get_completions(Document(typed, len(typed)), complete_event)
            else:
                yield from commands_completer.get_completions(document, complete_event)

    return ChatCompleter()


def _prompt_session():
    from prompt_toolkit import PromptSession
    from prompt_toolkit.completion import WordCompleter
    from prompt_toolkit.key_binding import KeyBindings

    from ladechat.ui.input_history import PrivateHistory

    bindings = KeyBindings()

    @bindings.add("escape", "enter")
    def _newline(event) -> None:
        event.current_buffer.insert_text("\n")

    completer = _chat_completer(WordCompleter(COMMANDS.names(), sentence=True, match_middle=False))
    return PromptSession(history=PrivateHistory(state_root() / "history"), key_bindings=bindings, completer=completer,
                         enable_open_in_editor=True,  # Ctrl-X Ctrl-E, as shells do
                         complete_while_typing=True)


def _read_message(read_line) -> str | None:
    """One message: a line, or a \"\"\"-block. None at end of input."""
    line = read_line(">>> ")
    if line is None:
        return None
    if not line.lstrip().startswith('"""'):
        return line
    body = line.lstrip()[3:]
    lines = []
    while not body.rstrip().endswith('"""'):
        lines.append(body)
        body = read_line("... ")
        if body is None:
            return "\n".join(lines)
    lines.append(body.rstrip()[:-3])
    return "\n".join(lines).strip("\n")


def _banner(bot: Backend) -> str:
    if not bot.ready:  # its settings come with the model
        mode = "the first answer waits for it · "
    elif bot.stats_reported:
        s = bot.settings
        mode = f"lookahead {'on' if s.lookahead else 'off'} (W={s.window} N={s.ngram} G={s.candidates}) · "
    else:
        mode = ""
    return f"[bold]ladechat[/] · {escape(bot.describe())} · {mode}/help for commands, Ctrl-D to quit"


def _load_watch(bot: Backend) -> dict:
    """prompt() arguments that, while a PendingBot loads, end the prompt with LoadFailed as soon as
    the load fails (rather than at the first answer)."""
    if not isinstance(bot, PendingBot):
        return {}
    if bot.settled:
        bot.bot()  # LoadFailed if it failed
        return {}
    from prompt_toolkit.application import get_app

    async def watch() -> None:
        while not bot.settled:
            await asyncio.sleep(0.1)
        app = get_app()
        message = bot.failure_message()
        if message is not None and not app.is_done:
            app.exit(exception=LoadFailed(message))

    return {"pre_run": lambda: get_app().create_background_task(watch())}


def run_chat(bot: Backend, system: str | None, debug: bool, out: Console, err: Console, markdown: bool = True,
             hide_thinking: bool = False, log: ChatLog | None = None, reopen: Path | None = None,
             switch: Callable[[str], Backend] | None = None) -> None:
    """log: where the chat is kept (None: not kept); reopen: a kept chat to go on with; switch: for
    /model (ChatApp)."""
    interactive = sys.stdin.isatty()
    if isinstance(bot, PendingBot) and not interactive:
        bot = bot.bot()  # a script gains nothing from an early prompt, and a failed load is its error at once
    app = ChatApp(bot, system, debug, out, err, markdown=markdown, hide_thinking=hide_thinking, log=log,
                  switch=switch)
    err.print(_banner(bot), highlight=False)
    if reopen is not None:
        app.reopen(reopen)
    if interactive:
        # Ctrl-C is how a user stops an answer. A process started from a script's background job
        # (or a launcher that ignores SIGINT) inherits SIGINT ignored, and Python then never raises
        # KeyboardInterrupt; someone typing at this chat is in the foreground, so take it back.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        session = _prompt_session()

        def read_line(prompt: str) -> str | None:
            try:
                return session.prompt(prompt, **_load_watch(bot))
            except EOFError:
                return None
            finally:
                if (notice := session.history.take_notice()) is not None:
                    err.print(f"notice: {notice}", style="yellow", highlight=False, markup=False, soft_wrap=True)
    else:
        def read_line(prompt: str) -> str | None:
            line = sys.stdin.readline()
            return line.rstrip("\n") if line else None

    try:
        chat_loop(app, read_line)
    finally:
        if log is not None:
            log.close()
    err.print("bye")


def chat_loop(app: ChatApp, read_line) -> None:
    """Read messages and commands with read_line(prompt) (None: end of input) until /exit."""
    while True:
        try:
            text = _read_message(read_line)
        except KeyboardInterrupt:
            continue  # Ctrl-C at the prompt clears the line, and drops an unfinished """ block
        if text is None:
            break
        if not text.strip():
            continue
        try:
            if text.lstrip().startswith("/"):
                if not app.command(text):
                    break
                continue
            app.ask(text)
        except KeyboardInterrupt:
            app.interrupted_outside_stream()
        except UserError as exc:  # the commands report their own; this catches what an answer raises
            app.error(str(exc))
