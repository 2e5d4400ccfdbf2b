"""The nanoserve TUI app: wires a source of frames to the panels and the keys.

    nanoserve tui --replay pressure.jsonl       a recorded trace, no model needed
    nanoserve tui --scenario memory-pressure    a live engine on a worker thread

The app owns the controls (step, run/pause, speed, dialogs) and three bits
of state, as reactives: the current `frame`, whether it is `playing`, and
the `speed`. Every panel is drawn from the frame alone. Sources (live or
replay) live in `source.py`, panels in `widgets/`, dialogs in `screens.py`,
layout in `app.tcss`.

Keys: the key bar lists only the controls this source can do (`Source.controls`,
via `check_action`); a hidden key still answers, with a notice saying why it does
not apply here. Focus starts nowhere, so the first Tab lands on the first panel
(the pool grid) and Tab walks the panels in reading order; ↑/↓ select a request
from anywhere no panel takes them. Every action is also in the command palette
(Ctrl+P), beside Textual's own (themes, keys, screenshot).
"""

from __future__ import annotations

import gc
import sys

from textual import on
from textual.app import App, ComposeResult, SystemCommand
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.reactive import reactive
from textual.screen import Screen
from textual.timer import Timer
from textual.widgets import Footer, Static

from nanoserve_tui.live_source import LiveSource
from nanoserve_tui.screens import AddRequestScreen, BranchScreen, HelpScreen, ScenarioPicker
from nanoserve_tui.source import (
    CONTROLS,
    FirstLoadProgress,
    Frame,
    FrameReady,
    LabStepFailed,
    Source,
    SourceStatus,
    Unsupported,
    replay_source,
)
from nanoserve_tui.widgets.event_log import EventLog
from nanoserve_tui.widgets.first_load import FirstLoad
from nanoserve_tui.widgets.free_queue import FreeQueue
from nanoserve_tui.widgets.metrics import Metrics
from nanoserve_tui.widgets.pool import PoolPanel
from nanoserve_tui.widgets.radix import RadixTree
from nanoserve_tui.widgets.requests import RequestList
from nanoserve_tui.widgets.status import StatusBar
from nanoserve_tui.widgets.tables import BlockTables

SPEEDS = (0.5, 1.0, 2.0, 4.0, 8.0, 16.0)   # steps per second when running


# The keys of the controls a source may not have (see `Source.controls`). When the source lacks one, the
# key bar hides it and the same key falls through to the hidden "why" binding after it, which runs the
# action anyway: the action (or the source) says why it does not apply here.
_CONTROL_KEYS = [
    ("space", "step", "step", True), ("n", "step", "step", False), ("r", "toggle_run", "run/pause", True),
    ("plus,equals_sign", "speed(1)", "faster", True), ("minus", "speed(-1)", "slower", True),
    ("b", "back", "back", True), ("left", "back", "back", False), ("a", "add", "add", True),
    ("x", "abort", "abort", True), ("f", "fork", "fork", True), ("p", "presets", "presets", True),
]
_KEY_DISPLAY = {"plus,equals_sign": "+", "minus": "-"}


def _why(action: str) -> str:
    """The hidden binding's action for `action`: "speed(1)" -> "why('speed', 1)"."""
    name, _, args = action.partition("(")
    return f"why('{name}'" + (f", {args}" if args else ")")


# (action, what the command palette calls it, its help) for the palette's list.
COMMANDS = [
    ("step", "Step", "one engine step forward (space)"), ("toggle_run", "Run / pause", "step on a timer (r)"),
    ("back", "Step back", "one step back; live: the run is replayed one step short (b)"),
    ("branch", "What if: branch from here", "replay the run with other settings (w)"),
    ("add", "Add a request", "prompt, max_tokens, temperature (a)"),
    ("abort", "Abort the selected request", "(x)"), ("fork", "Fork the selected request", "copy-on-write (f)"),
    ("presets", "Scenario presets", "restart with a preset scenario (p)"),
    ("speed(1)", "Faster", "more steps per second (+)"), ("speed(-1)", "Slower", "fewer steps per second (-)"),
    ("help", "nanoserve help", "what every key and panel means (?)"),
]


class NanoserveApp(App[None]):
    CSS_PATH = "app.tcss"
    TITLE = "nanoserve"
    AUTO_FOCUS = None          # no panel focused at first: the first Tab goes to the pool grid (reading order)
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (130, "-wide")]
    VERTICAL_BREAKPOINTS = [(0, "-short"), (40, "-tall")]
    BINDINGS = [
        *(Binding(keys, action, text, show=show, key_display=_KEY_DISPLAY.get(keys))
          for keys, action, text, show in _CONTROL_KEYS),
        *(Binding(keys, _why(action), text, show=False) for keys, action, text, _ in _CONTROL_KEYS),
        Binding("up", "select_request(-1)", "previous request", show=False),
        Binding("down", "select_request(1)", "next request", show=False),
        Binding("k", "rank", "rank", show=False),
        Binding("question_mark", "help", "help", key_display="?"),
        Binding("ctrl+l", "redraw", "redraw", show=False),
        Binding("q", "quit", "quit"),
        Binding("w", "branch", "what if"),    # last: on a narrow screen the footer cuts it, not quit
        Binding("w", _why("branch"), "what if", show=False),
    ]

    frame: reactive[Frame | None] = reactive(None, always_update=True)
    playing = reactive(False)
    speed = reactive(2)            # index into SPEEDS

    def __init__(self, source: Source) -> None:
        super().__init__()
        self.source = source
        self.status = ""           # what the source said last ("loading tiny-llama …")
        self.error: str | None = None
        self._added = 0            # ids for requests added from the dialog: u1, u2, ...
        self._ticker: Timer | None = None   # steps the source while playing
        self._held: list[tuple] = []        # toasts that came while the help was open

    def compose(self) -> ComposeResult:
        yield StatusBar(id="status")
        yield FirstLoad(id="first-load")       # a GGUF model's one-time conversion, tensor by tensor
        with Horizontal(id="body"):
            with Vertical(id="left"):
                yield PoolPanel(id="pool-panel", classes="panel")
                yield BlockTables(id="tables-panel", classes="panel")
                with Horizontal(id="queue-row"):
                    yield FreeQueue(id="free-panel", classes="panel")
                    yield RadixTree(id="radix", classes="panel")
            with Vertical(id="right"):
                yield RequestList(id="requests", classes="panel")
                yield EventLog(id="events", classes="panel")
                yield Metrics(id="metrics", classes="panel")
        yield Static(id="error-message")
        yield Static(id="lab-error")          # `--lab`: the step that failed in the student's code
        yield Footer(compact=True)

    def on_mount(self) -> None:
        # Every step allocates tens of thousands of short-lived segments, and each full garbage
        # collection would rescan the ~400k long-lived objects that importing torch and friends
        # left behind (5x the cost of drawing). Move those out of the collector's sight.
        gc.freeze()
        titles = {"pool-panel": "KV block pool", "tables-panel": "block tables (logical→physical)",
                  "free-panel": "free queue", "radix": "radix tree", "requests": "requests",
                  "events": "events this step", "metrics": "metrics"}
        for widget_id, title in titles.items():
            self.query_one(f"#{widget_id}").border_title = title
        self._restart_ticker()
        self.source.attach(self)

    def on_unmount(self) -> None:
        self.source.close()
        gc.unfreeze()

    # -- from the source --------------------------------------------------------------

    @on(FrameReady)
    def _frame_ready(self, message: FrameReady) -> None:
        self.frame = message.frame

    @on(SourceStatus)
    def _source_status(self, message: SourceStatus) -> None:
        self.status = message.text
        self.query_one("#body").loading = message.kind == "loading"
        if message.kind != "loading":
            self.query_one(FirstLoad).display = False
        if message.kind == "ready" and self.source.mode == "live":
            self.notify(message.text, title="engine ready")
        if message.kind == "error":
            self.error = message.text
            self.playing = False
            error = self.query_one("#error-message", Static)
            error.update(f"{message.text}\n\npress q to quit")
            error.display = True
            self.query_one("#body").display = False
        self._update_status()

    @on(FirstLoadProgress)
    def _first_load(self, message: FirstLoadProgress) -> None:
        self.query_one(FirstLoad).show(message.conversion)

    @on(LabStepFailed)
    def _lab_step_failed(self, message: LabStepFailed) -> None:
        """Pause on the failing step; one panel says where and what (the panels show the state it left)."""
        self.playing = False
        panel = self.query_one("#lab-error", Static)
        panel.update(f"{message.text}\nhint: {message.hint}\n(fix your file, then p to start again or b to step back)")
        panel.display = True

    def watch_frame(self, frame: Frame | None) -> None:
        if frame is None:
            return
        state = frame.state
        self.query_one(PoolPanel).state = state
        self.query_one(BlockTables).state = state
        self.query_one(FreeQueue).state = state
        self.query_one(RequestList).state = state
        self.query_one(RadixTree).state = state
        self.query_one("#body").set_class(state.prefix_caching, "-radix")   # the tree panel gets room
        self.query_one(EventLog).show_events(frame.events)
        self.query_one(Metrics).frame = frame
        self.query_one("#lab-error").display = bool(getattr(self.source, "lab_failed", None))
        if frame.at_end and self.playing and self.source.mode == "replay":
            self.playing = False
        self._update_status()

    def watch_playing(self, playing: bool) -> None:
        if self._ticker is not None:
            (self._ticker.resume if playing else self._ticker.pause)()
        self._update_status()

    def watch_speed(self, speed: int) -> None:
        if self._ticker is not None:
            self._restart_ticker()
        self._update_status()

    def _restart_ticker(self) -> None:
        if self._ticker is not None:
            self._ticker.stop()
        self._ticker = self.set_interval(1 / SPEEDS[self.speed], self._tick, pause=not self.playing)

    def _update_status(self) -> None:
        if not self.is_mounted or not self.query(StatusBar):
            return                 # reactives' first watch runs before the widgets exist
        frame = self.frame
        if frame is not None:
            last = f"/{frame.last_step}" if frame.last_step is not None else ""
            position = f"step {frame.state.step}{last}"
        else:
            position = self.status
        busy = self.source.busy
        # While a rewind or branch replays the run, the panels still show the old step: dim them.
        self.query_one("#body").set_class(busy is not None, "-busy")
        self.query_one(StatusBar).show(self.source.mode, self.source.description, position, self.playing,
                                       SPEEDS[self.speed], changes=self.source.changes, busy=busy,
                                       implementation=frame.state.implementation_line() if frame else "")

    # -- controls ---------------------------------------------------------------------

    def _tick(self) -> None:
        try:
            self.source.step(if_idle=True)
        except Unsupported as exc:
            self.playing = False
            self.notify(str(exc), title="paused")

    def _try(self, command, *args) -> bool:
        """Run a source command; a control that does not apply becomes a notice."""
        try:
            command(*args)
            return True
        except Unsupported as exc:
            self.notify(str(exc), severity="warning")
            return False

    def action_step(self) -> None:
        self._try(self.source.step)

    def action_back(self) -> None:
        self.playing = False
        self._try(self.source.back)
        self._update_status()      # a live rewind replays the run (seconds on a real model): say so now

    def action_why(self, action: str, *args) -> None:
        """A key the key bar hides here: run its action, which says why it does not apply."""
        getattr(self, f"action_{action}")(*args)

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """Hide (and leave to the `why` binding) the controls this source does not have."""
        return action not in CONTROLS or action in self.source.controls

    def get_system_commands(self, screen: Screen):
        """The command palette (Ctrl+P): Textual's own commands, then this source's controls."""
        yield from super().get_system_commands(screen)
        for action, title, help in COMMANDS:
            if self.check_action(action.split("(")[0], ()):
                yield SystemCommand(title, help, lambda action=action: self.run_action(action))

    def action_select_request(self, delta: int) -> None:
        """↑/↓ where no panel takes them: the request list gets the focus and moves its selection."""
        requests = self.query_one(RequestList)
        requests.focus()
        requests.action_move(delta)

    def action_toggle_run(self) -> None:
        if "toggle_run" not in self.source.controls:
            self._try(self.source.step)                   # says why (attached: the server steps itself)
            return
        if not self.playing and self.frame is not None and self.frame.at_end:
            if self.source.mode == "replay":
                self.notify("end of the trace: step back (b) first", severity="warning")
                return
        self.playing = not self.playing

    def action_speed(self, delta: int) -> None:
        if "speed" not in self.source.controls:
            self._try(self.source.step)                   # says why (attached: the server steps itself)
            return
        self.speed = max(0, min(len(SPEEDS) - 1, self.speed + delta))

    def _selected_request(self) -> str | None:
        rid = self.query_one(RequestList).selected_request if self.frame is not None else None
        if rid is None:
            self.notify("select a request first: click it, or use ↑/↓ in the request list", severity="warning")
        return rid

    def action_abort(self) -> None:
        if self.source.mode != "live":
            self._try(self.source.abort, "")              # says why it does not apply
            return
        rid = self._selected_request()
        if rid is None:
            return
        if rid in self.frame.state.finished:
            self.notify(f"{rid} has already finished", severity="warning")
            return
        if self._try(self.source.abort, rid):
            self.notify(f"aborting {rid}")

    def action_fork(self) -> None:
        if self.source.mode != "live":
            self._try(self.source.fork, "")               # says why it does not apply
            return
        rid = self._selected_request()
        if rid is not None and self._try(self.source.fork, rid):
            self.notify(f"forking {rid} …")              # the engine's answer follows as its own notice

    def action_branch(self) -> None:
        """Open "branch from here": the settings a class changes, the run's own filled in."""
        self.playing = False
        if not self.source.settings:
            self._try(self.source.branch, {})             # says why it does not apply
            return
        step = self.frame.state.step if self.frame else 0
        self.push_screen(BranchScreen(self.source.settings, step), self._branch)

    def _branch(self, changes: dict | None) -> None:
        if changes is not None and self._try(self.source.branch, changes):
            self._update_status()  # "branching …" until the replayed run arrives

    def action_add(self) -> None:
        if self.source.mode != "live":
            self._try(self.source.add_request, "", "", {})
            return
        self.push_screen(AddRequestScreen(self.source.chat_template), self._add_request)

    def _add_request(self, request: dict | None) -> None:
        if request is None:
            return
        known = self.frame.state.sequences if self.frame else {}
        self._added += 1
        while f"u{self._added}" in known:
            self._added += 1
        rid = f"u{self._added}"
        prompt = request.pop("prompt")
        if self._try(self.source.add_request, rid, prompt, request):
            self.notify(f"added {rid}")

    def action_presets(self) -> None:
        note = ("restarts the engine with the scenario you pick" if self.source.mode == "live"
                else "starts a live run of the scenario you pick (the replay ends)")
        self.push_screen(ScenarioPicker(note), self._preset_chosen)

    def _preset_chosen(self, name: str | None) -> None:
        if name is None:
            return
        self.playing = False
        if isinstance(self.source, LiveSource):
            self.source.restart(name)
        else:
            self.source.close()
            self.source = LiveSource(scenario=name)
            self.source.attach(self)
        self.notify(f"scenario {name}")
        self.refresh_bindings()     # a replay that became a live run has more controls
        self._update_status()

    def action_rank(self) -> None:
        """Tensor parallelism: speak for the next rank's pool (same tables, other KV heads)."""
        ranks = self.frame.state.ranks if self.frame is not None else []
        if not ranks:
            self.notify("one process: no ranks to switch (tensor_parallel_size=1)", severity="warning")
            return
        pool = self.query_one(PoolPanel)
        pool.selected_rank = (pool.selected_rank + 1) % len(ranks)

    def action_help(self) -> None:
        self.clear_notifications()             # toasts are drawn above every screen: none over the help
        self.push_screen(HelpScreen(), lambda _: self._show_held())

    def notify(self, message, *args, **kwargs) -> None:
        """A toast; while the help is open it waits until the help closes (it would cover the help's text)."""
        if isinstance(self.screen, HelpScreen):
            self._held.append((message, args, kwargs))
            return
        super().notify(message, *args, **kwargs)

    def _show_held(self) -> None:
        held, self._held = self._held, []
        for message, args, kwargs in held:
            self.notify(message, *args, **kwargs)

    def action_redraw(self) -> None:
        """Ctrl+L, as in a shell: draw the whole screen again (`nanoserve web --shared` sends it when a
        browser tab joins, whose terminal has seen none of the screen so far)."""
        self.screen.refresh(repaint=True)

    def action_quit(self) -> None:
        self.exit(return_code=2 if self.error else 0)


def make_source(model: str | None = None, replay: str | None = None, scenario: str | None = None,
                components=None, overrides: dict | None = None, explain=None) -> Source:
    """The source for the command line's choice; ValueError / OSError on bad input.
    `overrides`: engine settings over the scenario's (`--reading-path`: {"path": "reading"}); `explain`: for
    `--lab`, a failed step's exception -> (where and what, hint), shown in one panel."""
    if replay is not None:
        if model is not None or scenario is not None or components is not None or overrides:
            raise ValueError("--replay plays a recorded trace; it takes no --model, --scenario, --lab or "
                             "--reading-path")
        return replay_source(replay)
    return LiveSource(model=model, scenario=scenario, components=components, overrides=overrides, explain=explain)


def run_app(model: str | None = None, replay: str | None = None, scenario: str | None = None,
            components=None, overrides: dict | None = None, explain=None) -> int:
    """Run the TUI; returns the exit code (2 on a bad trace, scenario or model).
    `components` (from `--lab`) runs the live engine with a student's parts; `overrides`, other settings."""
    try:
        source = make_source(model, replay, scenario, components, overrides, explain)
    except (OSError, ValueError) as exc:
        print(f"nanoserve: error: {exc}", file=sys.stderr)
        return 2
    app = NanoserveApp(source)
    app.run()
    if app.error:
        print(f"nanoserve: error: {app.error}", file=sys.stderr)
        return 2
    return app.return_code or 0
