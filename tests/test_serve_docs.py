"""The serving docs cannot drift: the page's curl and openai examples run against a live server, the
architecture picture names only code that exists and is drawn from its script as it is, and the CLI's
`serve` command reports bad flags in one line."""

from __future__ import annotations

import html
import importlib
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from serve_helpers import running_server, save_chat_model

from nanoserve.cli import main
from nanoserve.models.loader import load_model

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "serve.md"
EXAMPLES = ROOT / "docs" / "examples"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    loaded = load_model(save_chat_model(tmp_path_factory.mktemp("chat-llama")))
    with running_server(loaded, api_key="docs-key") as (url, srv):
        yield url, loaded.name


def example_env(url: str, model: str) -> dict:
    return {**os.environ, "NANOSERVE_URL": url, "NANOSERVE_MODEL": model, "NANOSERVE_API_KEY": "docs-key",
            "OMP_NUM_THREADS": "1"}


def test_the_page_includes_both_examples_and_is_in_the_nav():
    text = PAGE.read_text()
    for name in ("serve_curl.sh", "serve_openai.py"):
        assert f'--8<-- "docs/examples/{name}"' in text
    assert "serve.md" in (ROOT / "mkdocs.yml").read_text()


@pytest.mark.skipif(shutil.which("curl") is None, reason="the curl example needs curl")
def test_curl_example_runs(served):
    url, model = served
    proc = subprocess.run(["bash", str(EXAMPLES / "serve_curl.sh")], capture_output=True, text=True,
                          env=example_env(url, model), timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert '"object":"list"' in out and '"text_completion"' in out
    assert '"chat.completion.chunk"' in out and "data: [DONE]" in out
    assert f'nanoserve_requests{{model_name="{model}",state="running"}}' in out


def test_openai_example_runs(served):
    url, model = served
    proc = subprocess.run([sys.executable, str(EXAMPLES / "serve_openai.py")], capture_output=True, text=True,
                          env=example_env(url, model), timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("chatcmpl-") and lines[-2].startswith("0 ") and lines[-1].startswith("1 ")


def load_picture_script():
    spec = importlib.util.spec_from_file_location("make_serving_pictures", ROOT / "docs/img/make_serving_pictures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_architecture_picture_names_real_code_and_is_current():
    pictures = load_picture_script()
    for ref in pictures.refs():
        module, _, path = ref.partition(":")
        obj = importlib.import_module(module)
        for part in path.split("."):
            obj = getattr(obj, part)                     # AttributeError: the picture names code that is gone
    svg = html.unescape(pictures.OUT.read_text())      # (Graphviz writes "-" as &#45;)
    for _, label, _ in pictures.CLIENTS + pictures.API + pictures.LOOP + pictures.QUEUES:
        for line in label.split("\\n"):                  # every box's text is in the committed picture
            assert line in svg, line
    shot = html.unescape(pictures.ATTACH_OUT.read_text())    # the attached TUI's screenshot (a real run)
    assert "ATTACH" in shot and "clients" in shot and "rejected" in shot and "disconnected" in shot


def run_cli(capsys, *argv):
    try:
        code = main(list(argv))
    except SystemExit as exc:
        code = exc.code
    return code, capsys.readouterr()


def test_serve_help_and_bad_flags(capsys):
    code, out = run_cli(capsys, "serve", "--help")
    assert code == 0
    for flag in ("--model", "--host", "--port", "--api-key", "--max-waiting", "--record", "--step-delay",
                 "--block-size", "--num-blocks"):
        assert flag in out.out
    for argv, words in [(["--port", "70000"], "--port"), (["--max-waiting", "0"], "--max-waiting"),
                        (["--step-delay", "-1"], "--step-delay")]:
        code, out = run_cli(capsys, "serve", *argv)
        lines = out.err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and lines[0].startswith("nanoserve: error:") and words in lines[0]


def test_serve_on_a_port_in_use_is_one_line(capsys):
    import socket
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        code, out = run_cli(capsys, "serve", "--port", str(busy.getsockname()[1]))
    assert code == 2 and "cannot listen on 127.0.0.1" in out.err and "Traceback" not in out.err


def test_nanoserve_serve_runs_as_a_command_and_stops_on_ctrl_c(tmp_path):
    """The real command in a subprocess: it says where it listens, answers, records, and Ctrl-C stops it cleanly."""
    import signal
    import socket
    import time

    import httpx

    from nanoserve.trace import fold_all, read_trace

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    trace = tmp_path / "served.jsonl"
    proc = subprocess.Popen([sys.executable, "-m", "nanoserve.cli", "serve", "--model", "tiny-llama", "--port",
                             str(port), "--record", str(trace), "--block-size", "4", "--num-blocks", "64"],
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 120
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "the server did not come up"
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        resp = httpx.post(url + "/v1/completions", json={"model": "tiny-llama", "prompt": "Hi", "max_tokens": 3},
                          timeout=30).json()
        assert resp["usage"]["completion_tokens"] == 3
        with httpx.stream("GET", url + "/events", timeout=30) as events:   # a watcher must not block shutdown
            assert next(events.iter_lines()) == "id: 1"
            proc.send_signal(signal.SIGINT)
            _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode in (0, 130), err               # 130: the usual code after Ctrl-C
    assert f"serving tiny-llama as 'tiny-llama' on {url}" in err and "Traceback" not in err
    assert fold_all(read_trace(trace)).finished == [resp["id"]]


def test_a_non_loopback_host_prints_a_warning(monkeypatch, capsys):
    """--host 0.0.0.0 warns (tested without listening beyond loopback: the socket and uvicorn are stand-ins)."""
    import socket

    import nanoserve.serve.background as background

    real_create_server = socket.create_server
    opened = []

    def loopback_instead(addr, **kwargs):                               # asked for 0.0.0.0, binds loopback
        opened.append(real_create_server(("127.0.0.1", 0), **kwargs))
        return opened[-1]

    monkeypatch.setattr(socket, "create_server", loopback_instead)
    monkeypatch.setattr(background.Uvicorn, "run", lambda self, sockets=None: None)
    code, out = run_cli(capsys, "serve", "--host", "0.0.0.0", "--port", "0", "--num-blocks", "16")
    assert code == 0
    assert "warning: listening on 0.0.0.0" in out.err and "--api-key" in out.err
    code, out = run_cli(capsys, "serve", "--host", "0.0.0.0", "--port", "0", "--num-blocks", "16", "--api-key", "k")
    assert "warning: listening on 0.0.0.0" in out.err and "set --api-key" not in out.err
    for sock in opened:
        sock.close()
