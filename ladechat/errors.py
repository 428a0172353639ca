"""The one base class of every error a user can cause and fix (a bad flag, setting, file, model or
command). Its message is one line meant for them; `main()` and the chat loop print it as such.
Anything else that escapes is a bug and keeps its traceback."""

from __future__ import annotations


class UserError(Exception):
    """Something the user gave cannot be used; str(error) says what, on one line."""


class ModelNotFound(UserError):
    """A model the user asked for is not there; the message says what to do."""
