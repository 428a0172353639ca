"""The documents say what the code does: every option of every command is in docs/usage.md, the
README stays short and names the two commands, and the documents' links lead to files that exist."""

import re
from pathlib import Path

import typer

from ladechat.cli import app

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = ["README.md", "BENCHMARKS.md", "docs/usage.md", "docs/design.md"]


def options(command, name: str = "chat"):
    for param in command.params:
        for flag in (*param.opts, *getattr(param, "secondary_opts", ())):
            if flag.startswith("--"):
                yield name, flag
    for sub_name, sub in getattr(command, "commands", {}).items():  # typer's groups
        yield from options(sub, sub_name if name == "chat" else f"{name} {sub_name}")


def test_every_option_of_every_command_is_in_the_usage_document():
    text = (ROOT / "docs/usage.md").read_text()
    found = list(options(typer.main.get_command(app)))
    assert len(found) > 60
    assert sorted({(command, flag) for command, flag in found if flag not in text}) == []


def test_the_readme_is_short_and_names_the_two_commands():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    assert "make chat" in readme and "make test" in readme
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^chat:", makefile, re.M) and re.search(r"^test:", makefile, re.M)


def test_the_documents_links_lead_to_files_that_exist():
    broken = []
    for name in DOCUMENTS:
        path = ROOT / name
        for target in re.findall(r"\]\(([^)#:\s]+)(?:#[^)]*)?\)", path.read_text()):
            if not (path.parent / target).exists():
                broken.append((name, target))
    assert broken == []
