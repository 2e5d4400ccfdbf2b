"""Displays that do not mislead, outside the TUI: one rendering of text, one name per sequence,
prompts that show, and one default temperature story."""

from __future__ import annotations

import asyncio
import io

from rich.console import Console

from nanoserve import EngineConfig, LLMEngine, SamplingParams
from nanoserve.viz.text import NO_TEXT, plural, shown, token_text


def plain(renderable) -> str:
    console = Console(file=io.StringIO(), width=160, color_system=None)
    console.print(renderable)
    return console.file.getvalue()


def test_one_rendering_of_text():
    assert shown("a\nb\tc\x07d\u0301e界") == "a⏎b→c·d·e·"          # combining and double-width: one cell
    assert token_text("") == NO_TEXT and token_text("\n") == "'⏎'"
    assert plural(1, "token") == "1 token" and plural(2, "token") == "2 tokens"


def test_token_id_prompt_shows_its_text():
    engine = LLMEngine(EngineConfig(model="tiny-llama", block_size=4, num_blocks=32))
    events = []
    engine.subscribe(events.append)
    engine.add_request("ids", [72, 105, 33], SamplingParams(max_tokens=2))        # bytes of "Hi!"
    (view,) = engine.snapshot()["sequences"]
    assert view["prompt"] == "Hi!"
    assert events[-1].prompt == "Hi!"                                              # RequestAdded agrees


def test_step_result_names_a_fork_as_every_panel_does():
    engine = LLMEngine(EngineConfig(model="tiny-llama", block_size=4, num_blocks=32))
    engine.add_request("r1", "Hello", SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    engine.step()
    engine.step()
    child = engine.fork("r1")
    result = engine.step()
    assert child == "r1.1" and child in engine.snapshot()["running"]
    (out,) = result.outputs
    assert [c.seq_id for c in out.outputs] == ["r1", "r1.1"]
    text = plain(result)
    assert "r1.1: token" in text and "#1" not in text


def test_one_default_temperature_story():
    """The command line and the TUI's add dialog are greedy by default; SamplingParams keeps vLLM's 1.0."""
    from textual.app import App
    from textual.widgets import Input

    from nanoserve.cli import build_parser, subparser
    from nanoserve_tui.screens import AddRequestScreen

    async def dialog_default() -> str:
        app = App()
        async with app.run_test() as pilot:
            await app.push_screen(AddRequestScreen())
            await pilot.pause()
            return app.screen.query_one("#temperature", Input).value

    default = subparser(build_parser(), "generate").get_default("temperature")
    assert default == float(asyncio.run(dialog_default())) == 0.0
    assert SamplingParams().temperature == 1.0
