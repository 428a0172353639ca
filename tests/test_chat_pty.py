"""Drive the real interactive `ladechat` in a pseudo-terminal, as a user would."""

import base64
import json
import os
import re
import signal
import subprocess
import time

import pexpect
import pytest
from conftest import ladechat_bin

from ladechat.ui.stream import MARKDOWN_BLOCKS

PROMPT = ">>>"  # prompt-toolkit wraps the prompt in escape codes


def chat_env(tmp_path, env_extra=None):
    return {**os.environ, "XDG_STATE_HOME": str(tmp_path / "state"), "TERM": "xterm", "PROMPT_TOOLKIT_NO_CPR": "1",
            "NO_COLOR": "1", **(env_extra or {})}


def spawn(tmp_path, sigint_ignored=False, env_extra=None, args=()):
    """sigint_ignored: start the chat as a script's background job would (SIGINT inherited ignored)."""
    env = chat_env(tmp_path, env_extra)
    disposition = signal.SIG_IGN if sigint_ignored else signal.SIG_DFL
    child = pexpect.spawn(ladechat_bin(), ["--dtype", "float32", "--max-new-tokens", "48", *args], env=env,
                          encoding="utf-8", timeout=120, dimensions=(40, 200),
                          preexec_fn=lambda: signal.signal(signal.SIGINT, disposition))
    child.expect(PROMPT)
    return child


def say(child, line, *expect):
    child.sendline(line)
    for pattern in expect:
        child.expect(pattern)
    child.expect(PROMPT)
    return child.before


def test_chat_session_end_to_end(tmp_path):
    child = spawn(tmp_path)
    child.sendline("What is the capital of France?")
    child.expect(r"tokens/step, lookahead W=")
    first_screen = child.before
    child.expect(PROMPT)
    say(child, "/lookahead off", "lookahead off from the next answer")
    say(child, "And of Germany?", r"tokens/step, lookahead off, context [\d,]+/8,192")
    say(child, "/context", r"context: [\d,]+ of 8,192 tokens \(\d+%\) after the last answer")
    say(child, "/set n=3 w=4", "W=4 N=3")
    say(child, "/stats", r"lookahead: 1 answers", r"plain: 1 answers")
    say(child, "/bogus", "unknown command /bogus")
    saved = tmp_path / "conv.json"
    say(child, f"/save {saved}", "saved 4 messages")
    data = json.loads(saved.read_text())
    assert [m["role"] for m in data["messages"]] == ["user", "assistant", "user", "assistant"]
    # what was saved is what the screen showed (whatever the model answered)
    words = re.findall(r"[A-Za-z]{2,}", data["messages"][1]["content"])
    # tokens accepted in parallel are bold (NO_COLOR keeps bold): where the codes fall inside a word
    # depends on how the steps were planned, so compare the screen's text without them
    screen = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", first_screen)
    assert words and all(word in screen for word in words[:3]) and data["settings"]["N"] == 3
    say(child, "/clear", "new conversation")
    say(child, "/context", "no answer yet in this conversation")
    notes = tmp_path / "notes.txt"
    notes.write_text("The lighthouse keeper's name is Ada.\n")
    say(child, f"/read {tmp_path / 'missing.txt'}", "error: no such file")
    say(child, f"/read {notes}", r"read notes.txt \(\d+ characters\): it goes with your next message")
    say(child, "What is the keeper's name?", "tokens/step")
    say(child, f"/read {notes} And again, briefly?", "tokens/step")
    said = tmp_path / "read.json"
    say(child, f"/save {said}", "saved 4 messages")
    asked = [m["content"] for m in json.loads(said.read_text())["messages"] if m["role"] == "user"]
    fenced = "notes.txt:\n```\nThe lighthouse keeper's name is Ada.\n```\n\n"
    assert asked == [fenced + "What is the keeper's name?", fenced + "And again, briefly?"]
    say(child, f"/load {saved}", "loaded 4 messages")
    say(child, "/load /no/such/file.json", "no such file")
    say(child, "/save /proc/forbidden/x.json", "error")
    child.sendline("/exit")
    child.expect("bye")
    child.expect(pexpect.EOF)


def test_ctrl_c_mid_answer_keeps_the_partial_answer_marked_interrupted(tmp_path):
    """The model has no end-of-text token and the answer may run for minutes: it cannot end before
    Ctrl-C. The chat runs as a script's background job would (SIGINT inherited ignored)."""
    from tiny_models import endless_model_folder

    folder = endless_model_folder(tmp_path / "endless")
    env = {**os.environ, "XDG_STATE_HOME": str(tmp_path / "state"), "TERM": "xterm", "PROMPT_TOOLKIT_NO_CPR": "1",
           "NO_COLOR": "1"}
    child = pexpect.spawn(ladechat_bin(), ["--model", str(folder), "--dtype", "float32", "--max-new-tokens", "4",
                                           "--no-lookahead"], env=env, encoding="utf-8", timeout=120,
                          dimensions=(40, 200), preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    child.expect(PROMPT)
    say(child, "Hi", "tokens/step")  # the model has loaded: what the screen shows next is the answer
    say(child, "/set max_new_tokens=200000", "lookahead off: W=")  # what /set says: not the typed line's echo
    child.sendline("Tell me a story.")
    # Ctrl-C is a signal only once prompt-toolkit has given the terminal back (it turns bracketed
    # paste off as it does); before that it would be a key press at the prompt. So: wait for that,
    # then for the answer on the screen.
    child.expect_exact("\x1b[?2004l")
    child.expect(r"[!-~]{20}")  # twenty printable characters of the answer in a row
    child.sendcontrol("c")
    child.expect(r"tokens/step, lookahead off \(interrupted\)")
    child.expect("interrupted: the partial answer is kept")
    child.expect(PROMPT)
    saved = tmp_path / "c.json"
    say(child, f"/save {saved}", "saved 4 messages")
    last = json.loads(saved.read_text())["messages"][-1]
    assert last["role"] == "assistant" and last["interrupted"] and len(last["content"]) >= 20
    child.sendline("/exit")
    child.expect("bye")
    child.expect(pexpect.EOF)


def test_greedy_chat_answers_identical_with_lookahead_on_and_off(tmp_path):
    child = spawn(tmp_path)
    question = "Write a Python function that returns the squares of a list of numbers."
    answers = []
    for mode in ("on", "off"):
        say(child, "/clear", "new conversation")
        say(child, f"/lookahead {mode}", f"lookahead {mode}")
        say(child, question, "tokens/step")
        path = tmp_path / f"{mode}.json"
        say(child, f"/save {path}", "saved 2 messages")
        answers.append(json.loads(path.read_text())["messages"][1]["content"])
    assert answers[0] == answers[1] and answers[0]
    child.sendeof()
    child.expect(pexpect.EOF)


def saved_messages(child, path, count):
    say(child, f"/save {path}", f"saved {count} messages")
    return json.loads(path.read_text())


def test_system_multiline_undo_retry_and_markdown(tmp_path):
    child = spawn(tmp_path)
    path = tmp_path / "c.json"
    child.send("this half-typed line is abandoned")
    child.sendcontrol("c")  # Ctrl-C at the prompt clears the line, the chat goes on
    say(child, "/stats", "no answers yet")
    say(child, "/system You are a terse assistant.", "system prompt set; new conversation")
    say(child, "/show", "system prompt: 'You are a terse assistant.'")
    # Alt+Enter (Esc, Enter) inserts a new line; Enter sends the whole message.
    child.send("Name a colour.")
    child.send("\x1b\r")
    child.send("Answer in one word.")
    child.send("\r")
    child.expect("tokens/step")
    child.expect(PROMPT)
    # A message that starts with """ runs until a line that ends with """.
    child.sendline('"""Write a Python function')
    child.sendline("that adds two numbers.")
    child.sendline('Use a code block."""')
    child.expect("tokens/step")
    child.expect(PROMPT)
    # Ctrl-C inside a """ block drops the unfinished block (else /stats would be one of its lines).
    child.sendline('"""This block is never finished')
    child.expect_exact("...")  # the continuation prompt
    child.sendcontrol("c")
    say(child, "/stats", r"lookahead: 2 answers")
    data = saved_messages(child, path, 4)
    assert data["system"] == "You are a terse assistant."
    questions = [m["content"] for m in data["messages"] if m["role"] == "user"]
    assert questions == ["Name a colour.\nAnswer in one word.",
                         "Write a Python function\nthat adds two numbers.\nUse a code block."]
    code_answer = data["messages"][3]["content"]
    # /retry regenerates the last answer (greedy: the same text); /undo drops question and answer.
    child.sendline("/retry")
    child.expect("tokens/step")
    screen = child.before
    child.expect(PROMPT)
    # a finished answer with Markdown blocks (the model's choice) is erased and redrawn, rendered; one without is not
    assert ("\r\x1b[2K\x1b[1A\x1b[2K" in screen) == (MARKDOWN_BLOCKS.search(code_answer) is not None)
    assert saved_messages(child, path, 4)["messages"][3]["content"] == code_answer
    say(child, "/undo", "dropped the last question and its answer")
    assert [m["content"] for m in saved_messages(child, path, 2)["messages"]][0] == questions[0]
    say(child, "/undo", "dropped the last question and its answer")
    say(child, "/undo", "nothing to undo")
    say(child, "/retry", "nothing to retry")
    say(child, "/system", "system prompt removed")
    assert saved_messages(child, path, 0)["system"] is None
    child.sendeof()
    child.expect(pexpect.EOF)


def test_prompt_comes_before_the_model_and_ctrl_c_stops_the_wait(tmp_path):
    child = spawn(tmp_path)  # at the prompt: torch is still importing (seconds on this machine)
    assert "the embedded model (loading) · the first answer waits for it" in child.before
    child.sendline("What is the capital of France?")
    child.expect_exact("\x1b[?2004l")  # the terminal is given back: Ctrl-C is a signal again
    child.expect("loading the embedded model: ")  # the spinner while the answer waits for the model
    child.sendcontrol("c")
    child.expect(r"interrupted while the model loads \(it goes on loading; /retry answers\)")
    child.expect(PROMPT)
    say(child, "/retry", "tokens/step")
    data = saved_messages(child, tmp_path / "c.json", 2)
    assert [m["role"] for m in data["messages"]] == ["user", "assistant"]
    assert not data["messages"][1]["interrupted"] and data["messages"][1]["content"]
    child.sendeof()
    child.expect(pexpect.EOF)


def test_a_model_that_fails_to_load_ends_the_chat_at_the_prompt(tmp_path):
    env = {**os.environ, "XDG_STATE_HOME": str(tmp_path / "state"), "TERM": "xterm", "PROMPT_TOOLKIT_NO_CPR": "1"}
    child = pexpect.spawn(ladechat_bin(), ["--model", "/no/such/folder"], env=env, encoding="utf-8", timeout=120)
    child.expect(PROMPT)
    child.expect_exact("ladechat: error: model folder not found: /no/such/folder")  # nothing typed
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 1
    assert "Traceback" not in child.before


def test_leaving_while_the_model_loads_exits_cleanly_at_once(tmp_path):
    child = spawn(tmp_path)
    assert "(loading)" in child.before  # still loading: the exit below does not wait for it
    child.sendline("/exit")
    child.expect("bye")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0 and child.signalstatus is None


@pytest.mark.parametrize("path", ["in-process", "warm server", "--api"])
def test_a_question_too_long_for_the_context_leaves_the_conversation_before_it(tmp_path, path):
    """Through each path a chat can answer by, alike: the too-long question is one error line and is
    not kept, and the exchange before it stays (what /save writes)."""
    from serve_process import Server
    from test_cli import tiny_model_folder
    from tiny_models import tiny_tokenizer

    folder = str(tiny_model_folder(tmp_path / "small", tiny_tokenizer()))  # a context of 512 tokens
    env = {**os.environ, "XDG_STATE_HOME": str(tmp_path / "state"), "TERM": "xterm", "PROMPT_TOOLKIT_NO_CPR": "1",
           "NO_COLOR": "1", "LADECHAT_RUNTIME_DIR": str(tmp_path / "run")}
    args = ["--max-new-tokens", "8"]
    server = None
    if path == "in-process":
        args += ["--model", folder, "--dtype", "float32", "--keep-alive", "0"]
    elif path == "warm server":
        args += ["--model", folder, "--dtype", "float32", "--keep-alive", "5m"]
    else:
        server = Server("--model", folder, "--dtype", "float32", "--no-store")
        args += ["--api", server.url]
    try:
        child = pexpect.spawn(ladechat_bin(), args, env=env, encoding="utf-8", timeout=120, dimensions=(40, 200))
        child.expect(PROMPT)
        say(child, "Hi", "tokens/step")
        saved = tmp_path / "c.json"
        first = saved_messages(child, saved, 2)["messages"]
        child.sendline("x" * 1000)  # one token a character: twice the model's context
        child.expect(r"error: .*the prompt is \d+ tokens, more than the \d+ that fit in the model's context")
        child.expect(PROMPT)
        assert saved_messages(child, saved, 2)["messages"] == first
        say(child, "And then?", "tokens/step")  # the chat goes on, the first exchange in its context
        assert [m["content"] for m in saved_messages(child, saved, 4)["messages"][::2]] == ["Hi", "And then?"]
        child.sendeof()
        child.expect(pexpect.EOF)
    finally:
        if server is not None:
            server.stop()
        subprocess.run([ladechat_bin(), "stop", "--all"], env=env, capture_output=True, timeout=60, check=False)


def test_edit_writes_the_message_in_the_editor_and_copy_puts_the_answer_on_the_clipboard(tmp_path):
    """/edit runs $EDITOR on a file and sends what it holds; an editor that fails sends nothing.
    /copy writes the last answer to the terminal as OSC 52, the clipboard request terminals take."""
    editor = tmp_path / "editor.sh"
    editor.write_text('#!/bin/sh\n[ -f "$EDITOR_FAILS" ] && exit 3\nprintf "What is two plus two?\\n" >> "$1"\n')
    editor.chmod(0o755)
    fails = tmp_path / "fails"
    child = spawn(tmp_path, env_extra={"VISUAL": str(editor), "EDITOR_FAILS": str(fails)})
    say(child, "/copy", "error: no answer to copy yet")
    fails.touch()
    say(child, "/edit", r"the editor '.*editor.sh' ended with status 3; nothing sent")
    fails.unlink()
    say(child, "/edit", "tokens/step")
    child.sendline("/copy")
    child.expect("\x1b\\]52;c;([A-Za-z0-9+/=]+)\x07")
    copied = base64.b64decode(child.match.group(1)).decode("utf-8")
    child.expect("copied the last answer")
    child.expect(PROMPT)
    saved = tmp_path / "edit.json"
    say(child, f"/save {saved}", "saved 2 messages")
    messages = json.loads(saved.read_text())["messages"]
    assert messages[0]["content"] == "What is two plus two?"
    assert copied == messages[1]["content"] and copied.strip()
    child.sendline("/exit")
    child.expect(pexpect.EOF)


def test_a_killed_chat_is_kept_listed_printed_and_continued(tmp_path):
    """The chat is kept as it goes: the question is in its file before the answer begins, so a chat
    killed then (or later) loses nothing; `ladechat --continue` goes on with it, in the same file."""
    from conftest import PATIENCE_S

    env = chat_env(tmp_path)
    child = spawn(tmp_path)
    say(child, "What is the capital of France?", "tokens/step")
    child.sendline("Name a colour.")
    chats = tmp_path / "state" / "ladechat" / "chats"
    deadline = time.monotonic() + PATIENCE_S
    while not any("Name a colour." in p.read_text() for p in chats.glob("*.json")) and time.monotonic() < deadline:
        time.sleep(0.05)
    child.kill(signal.SIGKILL)  # the terminal is gone, whether the answer had ended or not
    child.close()

    def history(*args):
        done = subprocess.run([ladechat_bin(), "history", *args], env=env, capture_output=True, text=True, check=False,
                              timeout=PATIENCE_S)
        assert done.returncode == 0, done.stderr
        return done.stdout

    listing = history().splitlines()
    assert len(listing) == 1 and "What is the capital of France?" in listing[0]
    kept = json.loads(history("1", "--json"))["messages"]
    assert [(m["role"], m["content"]) for m in kept[::2]] == [("user", "What is the capital of France?"),
                                                                ("user", "Name a colour.")]
    assert history("1").startswith(f"# Chat {listing[0].split()[3]}\n\nModel: SmolLM2")
    assert "## You\n\nName a colour." in history("1")

    child = spawn(tmp_path, args=["--continue"])
    assert re.search(rf"reopened chat {listing[0].split()[3]}: {len(kept)} messages", child.before)
    say(child, "/retry", "tokens/step")  # the question answered (again, if it had been)
    say(child, "And of Germany?", "tokens/step")
    child.sendline("/exit")
    child.expect(pexpect.EOF)
    assert len(history().splitlines()) == 1  # the same chat, gone on
    roles = [m["role"] for m in json.loads(history("1", "--json"))["messages"]]
    assert roles == ["user", "assistant"] * 3

    child = pexpect.spawn(ladechat_bin(), ["--resume", "--max-new-tokens", "8"], env=env, encoding="utf-8",
                          timeout=120, dimensions=(40, 200))
    child.expect(r"  1  .* 6 messages .*What is the capital of France\?")
    child.expect_exact("open which chat (number or id; Enter: a new chat)? ")
    child.sendline("1")
    child.expect(rf"reopened chat {listing[0].split()[3]}: 6 messages, the last 4 below")
    child.expect(PROMPT)
    child.sendline("/exit")
    child.expect(pexpect.EOF)

    child = spawn(tmp_path, args=["--no-history"])
    say(child, "/history", "chats are not kept in this session")
    say(child, "Hello?", "tokens/step")
    child.sendline("/exit")
    child.expect(pexpect.EOF)
    assert len(history().splitlines()) == 1
    refused = subprocess.run([ladechat_bin(), "--continue", "--no-history"], env=env, capture_output=True, check=False,
                             text=True, timeout=PATIENCE_S)
    assert refused.returncode == 1 and refused.stderr.startswith("ladechat: error: --continue opens a kept chat")
    missing = subprocess.run([ladechat_bin(), "history", "7"], env=env, capture_output=True, text=True, check=False,
                             timeout=PATIENCE_S)
    expected = "ladechat: error: no chat number 7: there are 1 (see: ladechat history)\n"
    assert (missing.returncode, missing.stderr) == (1, expected)


def test_model_switches_the_model_and_keeps_the_conversation(tmp_path):
    """/model opens another model as the chat opened its own; the conversation goes on with it,
    and one that cannot be opened is one line, the old model answering on."""
    from test_cli import tiny_model_folder
    from transformers import AutoTokenizer

    from ladechat.engine.load.gguf import files as gguf_files

    folder = tmp_path / "tiny"
    tiny_model_folder(folder, AutoTokenizer.from_pretrained(gguf_files.ensure_prepared(gguf_files.embedded_gguf())))
    child = spawn(tmp_path)
    say(child, "What is the capital of France?", "tokens/step")
    say(child, "/model /no/such/folder", r"error: /model /no/such/folder: model folder not found: /no/such/folder; "
                                         r"the chat goes on with SmolLM2")
    say(child, "/model", "model SmolLM2")
    say(child, f"/model {folder}", r"now answering with .*tiny.*; the conversation \(2 messages\)\s+goes\s+on")
    say(child, "And of Germany?", "tokens/step")
    data = saved_messages(child, tmp_path / "c.json", 4)
    assert data["model"].endswith("tiny") and [m["role"] for m in data["messages"]] == ["user", "assistant"] * 2
    child.sendline("/exit")
    child.expect(pexpect.EOF)
