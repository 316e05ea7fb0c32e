"""One status line that a long wait keeps current."""

from __future__ import annotations

from rich.console import Console


class LiveLine:
    """On a terminal, one line rewritten in place; elsewhere (a log file, a pipe) a new line each
    time the text changes, so a log of a long wait reads as what happened, not as a status
    repeated every poll with carriage returns in it."""

    def __init__(self, console: Console | None = None):
        self.console, self.last = console or Console(highlight=False), ""

    def show(self, text: str) -> None:
        if text == self.last:
            return
        self.last = text
        if self.console.is_terminal:
            self.console.file.write("\r\033[K" + text)
            self.console.file.flush()
        else:
            self.console.print(text, markup=False, highlight=False)

    def done(self) -> None:
        """Ends a line left open on a terminal."""
        if self.console.is_terminal and self.last:
            self.console.file.write("\n")
            self.console.file.flush()
        self.last = ""
