"""The startup screen: shows load progress, or the load error and waits for a key to exit."""
from __future__ import annotations

from rich.text import Text
from textual import events
from textual.app import ComposeResult
from textual.containers import Center, Vertical
from textual.screen import Screen
from textual.widgets import Label, ProgressBar, Static


class LoadingScreen(Screen):
    """Shown while the model loads in a worker thread."""

    def __init__(self, model_name: str) -> None:
        super().__init__(id="loading")
        self.model_name = model_name
        self.error: str | None = None

    def compose(self) -> ComposeResult:
        with Vertical(id="loading-box"):
            yield Static(Text("edgellm", style="bold"), id="loading-title")
            yield Label(f"loading {self.model_name} …", id="loading-what")
            with Center():
                yield ProgressBar(total=None, show_eta=False, show_percentage=False, id="loading-bar")
            yield Label("", id="loading-detail")

    def progress(self, count: int, name: str) -> None:
        if self.error is None:
            self.query_one("#loading-detail", Label).update(f"{count} tensors · {name}")

    def stage(self, text: str) -> None:
        if self.error is None:
            self.query_one("#loading-what", Label).update(text)

    def show_error(self, message: str) -> None:
        """The same one line the CLI prints, then any key exits with code 2."""
        self.error = message
        self.query_one("#loading-bar", ProgressBar).display = False
        self.query_one("#loading-what", Label).update(Text(f"edgellm: error: {message}", style="bold red"))
        self.query_one("#loading-detail", Label).update("press any key to exit")
        self.add_class("failed")

    def on_key(self, event: events.Key) -> None:
        if self.error is not None:
            event.stop()
            self.app.exit(return_code=2)
