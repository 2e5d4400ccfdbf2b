"""Modal screens: add a request, pick a scenario preset, branch with other settings, help.

Each returns its answer with `dismiss()`; the app decides what to do with it.
"""

from __future__ import annotations

from rich.table import Table
from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Checkbox, Input, Label, OptionList, Static
from textual.widgets.option_list import Option

from nanoserve.errors import FieldError
from nanoserve.kv_usage import CACHED, HIT_RATE, USED
from nanoserve.scenarios import SCENARIOS
from nanoserve.whatif.settings import BRANCH_SETTINGS, parse_sets


class FormScreen(ModalScreen[dict | None]):
    """A dialog form: Enter or its `.submit` button dismisses with `answer()`, unless that is None
    (the reason is shown in its `#error` label); Escape or `#cancel` dismisses with None.
    It opens with its first field focused, so typing goes straight into it."""

    AUTO_FOCUS = "Input"
    BINDINGS = [Binding("escape", "cancel", "cancel")]

    def answer(self) -> dict | None:
        raise NotImplementedError

    def _error(self, text: str) -> None:
        self.query_one("#error", Label).update(Text(text, style="bold red"))
        return None

    @on(Button.Pressed, ".submit")
    @on(Input.Submitted)
    def submit(self) -> None:
        answer = self.answer()
        if answer is not None:
            self.dismiss(answer)

    @on(Button.Pressed, "#cancel")
    def action_cancel(self) -> None:
        self.dismiss(None)


class AddRequestScreen(FormScreen):
    """Prompt, max_tokens and temperature for a new request; dismisses with the request or None.

    `chat_template`: the model's name when it has a chat template (an instruct model such as SmolLM2).
    Then a checkbox, on by default, wraps the prompt in it, as `nanoserve generate --chat` and the
    presets do: an instruct model answers a bare question badly."""

    def __init__(self, chat_template: str | None = None) -> None:
        super().__init__()
        self.chat_template = chat_template

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog"):
            yield Label("Add a request", classes="dialog-title")
            yield Label("prompt")
            yield Input(placeholder="e.g. The capital of France is", id="prompt")
            with Horizontal(classes="fields"):
                with Vertical():
                    yield Label("max_tokens")
                    yield Input("16", type="integer", id="max-tokens")
                with Vertical():
                    yield Label("temperature (0 = greedy)")
                    yield Input("0", type="number", id="temperature")   # as `nanoserve generate`
            if self.chat_template is not None:
                yield Checkbox(f"wrap it in {self.chat_template}'s chat template (as generate --chat)",
                               True, id="chat")
            yield Label("", id="error")
            with Horizontal(classes="buttons"):
                yield Button("Add", variant="primary", id="add", classes="submit")
                yield Button("Cancel", id="cancel")

    def answer(self) -> dict | None:
        """The form as SamplingParams fields plus the prompt, or None (with the reason shown)."""
        prompt = self.query_one("#prompt", Input).value
        try:
            max_tokens = int(self.query_one("#max-tokens", Input).value)
            temperature = float(self.query_one("#temperature", Input).value)
        except ValueError:
            return self._error("max_tokens must be a whole number and temperature a number")
        if not prompt.strip():
            return self._error("the prompt is empty")
        if max_tokens < 1:
            return self._error("max_tokens must be at least 1")
        if temperature < 0:
            return self._error("temperature must be 0 or more")
        request = {"prompt": prompt, "max_tokens": max_tokens, "temperature": temperature}
        if self.chat_template is not None and self.query_one("#chat", Checkbox).value:
            request["chat"] = True
        return request


class BranchScreen(FormScreen):
    """"What if, from this step": the settings a class changes, filled in with the run's own.

    Dismisses with the changed settings ({} when none changed) or None. A value the engine
    would refuse is caught here, with the same sentence `nanoserve compare --set` prints.
    """

    def __init__(self, settings: dict, step: int) -> None:
        super().__init__()
        self.settings, self.step = settings, step

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="dialog"):
            yield Label(f"Branch from step {self.step}: what if ...", classes="dialog-title")
            yield Static("The run is replayed from step 0 with these settings (same requests, same seeds) and "
                         "continues from here; up to the first step a setting matters, it is the same run.",
                         classes="dialog-note")
            for name in BRANCH_SETTINGS:
                with Horizontal(classes="setting"):
                    yield Label(name, classes="setting-name")
                    yield Input(_text(self.settings.get(name)), id=f"set-{name}")
            yield Label("", id="error")
            with Horizontal(classes="buttons"):
                yield Button("Branch", variant="primary", id="branch", classes="submit")
                yield Button("Cancel", id="cancel")

    def answer(self) -> dict | None:
        """The settings that differ from the run's, parsed and checked (None: an error is shown)."""
        items = [f"{name}={self.query_one(f'#set-{name}', Input).value.strip()}" for name in BRANCH_SETTINGS]
        try:
            values = parse_sets(items)
        except FieldError as exc:
            return self._error(exc.text)
        return {k: v for k, v in values.items() if v != self.settings.get(k)}


def _text(value) -> str:
    return "none" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


class ScenarioPicker(ModalScreen[str | None]):
    """The scenario presets with what to watch for in each; dismisses with a name or None."""

    AUTO_FOCUS = "OptionList"     # (the app focuses nothing by itself: each dialog says what it focuses)
    BINDINGS = [Binding("escape", "cancel", "cancel")]

    def __init__(self, note: str) -> None:
        super().__init__()
        self.note = note

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog"):
            yield Label("Scenario presets", classes="dialog-title")
            yield Label(self.note, classes="dim")
            yield OptionList(*[
                Option(Text.assemble((name, "bold"), "\n", (s.description, "dim")), id=name)
                for name, s in SCENARIOS.items()
            ], id="scenarios")

    @on(OptionList.OptionSelected)
    def chosen(self, message: OptionList.OptionSelected) -> None:
        self.dismiss(message.option.id)

    def action_cancel(self) -> None:
        self.dismiss(None)


KEYS = [
    ("space / n", "one step forward"),
    ("r", "run / pause (at the speed in the status line)"),
    ("+ / -", "faster / slower"),
    ("b / ←", "one step back (live: the command log is replayed into a fresh engine on the same weights, "
              "one step short; ← moves the block cursor while the pool grid has focus)"),
    ("w", "what if: branch from this step with other settings (preemption, prefix cache, block size, token "
          "budget, seats, speculative decoding, pool size; live only)"),
    ("a", "add a request: prompt, max_tokens, temperature (default 0: greedy, like `nanoserve generate`; "
          "with an instruct model, wrapped in its chat template unless you untick it; live only)"),
    ("x", "abort the selected request (live only)"),
    ("f", "fork the selected running request (live only): the copy shares every block, copy-on-write"),
    ("p", "scenario presets (live: restart the engine with one; replay: start a live run of one)"),
    ("tab", "focus the next panel, in reading order from the pool grid: in the pool grid arrows select a "
            "block, in the request list ↑/↓ select a request, elsewhere arrows scroll; with no panel focused "
            "↑/↓ select a request"),
    ("k", "tensor parallelism: the next rank's pool (the same block tables, its own KV heads)"),
    ("ctrl+p", "the command palette: every action above by name, and Textual's own (theme, keys, screenshot)"),
    ("?", "this help"),
    ("q", "quit"),
    ("", "the key bar at the bottom lists only the keys that do something here: a replay has no a, x, f, w; "
         "attached to a server the view only watches (a hidden key says why)"),
]
PANELS = [
    ("KV block pool", "one cell per physical block: grey when free, a request's colour when it holds the "
                      "block, white when several requests' tables share it, slate when only the prefix cache "
                      "holds it (cached: a hit can reuse it, eviction can free it); underlined = allocated, "
                      "freed, copied or shared this step. A cell's second line names its owner: a request id, "
                      "\"cache\", or on a shared (white) block xN, its ref count: N holders, each block table "
                      "that points at it plus one for the prefix cache when the cache holds it (x6: five "
                      "requests' tables and the cache); the third line, how full it is (3/8 tokens). "
                      "With swapping on, a strip shows the CPU swap pool. "
                      "Select a block (click, or arrows) to see its ref count, owners, cache node and the "
                      "token positions it holds for each. Across processes a bar under the grid shows the "
                      "ranks of tensor parallelism (each rank's KV heads; what it wrote, copied and swapped; "
                      "✓ when every rank's pool holds the same tokens in the same slots) and this step's "
                      "collectives, or the KV handoffs received from a prefill engine (its blocks → ours)."),
    ("block tables", "per request, logical block → physical block; (3/4) marks a partly filled last block, "
                     "where the next tokens' K/V go; * a block shared with another request; swapped-out "
                     "requests list their CPU blocks."),
    ("free queue", "free blocks in LRU order, head (handed out next) first; freed and evicted blocks join the "
                   "tail."),
    ("radix tree", "the prefix cache: each node a span of whole blocks, a path from the root a cached prefix. "
                   "\"lock N\": N live requests use it (it cannot be evicted), \"evictable\": no request uses it, "
                   "its blocks still hold cached K/V (not free blocks: eviction frees them); [blocks]; "
                   "@step of its last use. Yellow = hit this step, green = new, struck through = evicted. "
                   "Hidden under 130 columns when the engine has no prefix cache."),
    ("requests", "running, waiting, swapped out (KV in the CPU pool) and finished: tokens generated of "
                 "max_tokens, prompt tokens, tokens with K/V in the cache, and the newest text (⏎ a newline, → a tab, "
                 "⟨bytes⟩ bytes that spell no whole character yet; a random tiny model's text is noise)."),
    ("events", "everything the engine decided this step, in order."),
    ("metrics", "one bar per step, measured from zero on a fixed scale: tokens computed per step (the "
                "scale: the run's largest step; the title: tokens per second of the latest step), KV blocks "
                f"used (0-100 % of the pool; used = {USED}; with a prefix cache the label adds cached = "
                f"{CACHED}), \"accepted\": the share of drafted tokens the target accepted (speculative "
                f"decoding), and \"cache hit\": {HIT_RATE}. These are the definitions and the numbers of "
                "the server's /metrics."),
]


def help_table(title: str, rows: list[tuple[str, str]]) -> Table:
    table = Table(title=title, title_justify="left", title_style="bold", show_header=False, box=None,
                  padding=(0, 2, 0, 0), expand=True)
    table.add_column(style="bold #e5c07b", no_wrap=True)
    table.add_column(ratio=1)
    for name, text in rows:
        table.add_row(Text(name), Text(text))    # plain text: "[blocks]" is not markup
    return table


class HelpScreen(ModalScreen[None]):
    AUTO_FOCUS = "#dialog"        # arrows scroll the help
    BINDINGS = [Binding("escape,q,question_mark", "close", "close")]

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="dialog"):
            yield Label("nanoserve TUI", classes="dialog-title")
            yield Static(help_table("Keys", KEYS))
            yield Static(help_table("Panels", PANELS), classes="help-panels")

    def action_close(self) -> None:
        self.dismiss(None)
