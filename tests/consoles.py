"""Output files for front-end tests, local and remote (no torch here)."""

import io


class InterruptedConsole(io.StringIO):
    """The chat's output, where Ctrl-C arrives while the `at`-th piece of an answer is printed."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.at, self.writes = at, 0

    def write(self, text: str) -> int:
        self.writes += 1
        if self.writes == self.at:
            raise KeyboardInterrupt
        return super().write(text)
