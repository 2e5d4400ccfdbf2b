"""Structured output: the grammar's mask restricts the model's distribution, and every mechanism keeps it.

The oracle is independent of the engine's matcher bookkeeping: a fresh xgrammar
matcher replays a sequence's tokens from the start and says what it allows
next (`allowed_after`). Greedy and beam outputs are compared with Hugging Face
`generate` restricted by `prefix_allowed_tokens_fn` with that oracle; sampled
first tokens with the exact masked distribution; preemption, swap, chunked
prefill, the prefix cache, a failed step, speculative decoding and a what-if
replay must not change a single token.
"""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
from conftest import make_engine, run_to_end
from transformers import AutoModelForCausalLM

from nanoserve import SamplingParams
from nanoserve import events as ev
from nanoserve.errors import FieldError
from nanoserve.sampler import SamplingRow, probs
from nanoserve.sampling_params import StructuredOutputsParams
from nanoserve.structured_output import allowed_tokens, compiler_for

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "age"]}
SPECS = {
    "json": StructuredOutputsParams(json=PERSON),
    "regex": StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{2,4}"),
    "choice": StructuredOutputsParams(choice=["yes", "no", "a.b|c", "x-y"]),
    "grammar": StructuredOutputsParams(grammar='root ::= "(" [a-c]+ ")" | "none"'),
    "json_object": StructuredOutputsParams(json_object=True),
}


def matches(kind: str, text: str) -> bool:
    """The output is what the grammar describes (checked without xgrammar)."""
    if kind == "json":   # (name's maxLength is not checked: a random byte model can spell a surrogate code
        value = json.loads(text)   # point, which xgrammar counts as one character and the decoder as three)
        return set(value) == {"name", "age"} and isinstance(value["name"], str) \
            and isinstance(value["age"], int) and 0 <= value["age"] <= 99
    if kind == "regex":
        return re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", text) is not None
    if kind == "choice":
        return text in SPECS["choice"].choice
    if kind == "grammar":
        return re.fullmatch(r"\([a-c]+\)|none", text) is not None
    return isinstance(json.loads(text), dict)


def allowed_after(engine, spec, output: list[int]) -> list[int]:
    """The oracle: a fresh matcher fed `output` from the start; the tokens it allows next."""
    grammar = compiler_for(engine.tokenizer, engine.vocab_size, engine.eos_token_id).matcher(spec)
    for t in output:
        assert grammar.matcher.accept_token(t)
    return allowed_tokens(grammar.next_mask(), engine.vocab_size)


def finished_texts(engine) -> dict:
    return {rid: [(c.text, c.token_ids, c.finish_reason, c.error) for c in out.outputs]
            for rid, out in run_to_end(engine).items()}


# -- bad input -------------------------------------------------------------------------------------

@pytest.mark.parametrize("fields, field", [
    (dict(regex="(a+"), "structured_outputs.regex"), (dict(json="{bad"), "structured_outputs.json"),
    (dict(json={"type": "integer", "minimum": 5, "maximum": 3}), "structured_outputs.json"),
    (dict(json={"type": "strin"}), "structured_outputs.json"),
    (dict(grammar="root ::= foo"), "structured_outputs.grammar"), (dict(choice=[]), "structured_outputs.choice"),
    (dict(regex="a", choice=["b"]), "structured_outputs"), (dict(), "structured_outputs"),
])
def test_a_bad_grammar_is_one_field_error_and_nothing_is_queued(tiny_llama, fields, field):
    engine = make_engine(tiny_llama, num_blocks=64)
    with pytest.raises(FieldError) as err:
        engine.add_request("r", "Hi", SamplingParams(structured_outputs=fields))
    assert err.value.field == field and "\n" not in str(err.value) and "/project/" not in str(err.value)
    assert not engine.requests and not engine._events
    with pytest.raises(FieldError, match="ignore_eos"):
        SamplingParams(ignore_eos=True, structured_outputs=dict(regex="a"))


def test_a_model_without_tokenizer_refuses_structured_output(tmp_path):
    from conftest import save_tiny

    from nanoserve.models.loader import load_model
    engine = make_engine(load_model(save_tiny("tiny-llama", tmp_path, with_tokenizer=False)), num_blocks=32)
    with pytest.raises(FieldError, match="tokenizer") as err:
        engine.add_request("r", [1, 2, 3], SamplingParams(structured_outputs=dict(regex="a+")))
    assert err.value.field == "structured_outputs" and not engine.requests


def test_a_grammar_that_cannot_continue_ends_the_request_with_a_reason(tiny_llama):
    """"yes" then only EOS, which min_tokens=5 forbids: the request ends (abort, with why), it does not hang."""
    engine = make_engine(tiny_llama, num_blocks=64)
    engine.add_request("r", "Hi", SamplingParams(min_tokens=5, max_tokens=8,
                                                 structured_outputs=dict(choice=["yes"])))
    (text, tokens, reason, error), = finished_texts(engine)["r"]
    assert text == "yes" and reason == "abort" and "structured output" in error and "min_tokens=5" in error


# -- the output matches the grammar, whatever the model wants ----------------------------------------

@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_kind_of_grammar_shapes_a_random_model(tiny_llama, temperature):
    engine = make_engine(tiny_llama, block_size=4, num_blocks=256, max_num_seqs=16)
    for kind, spec in SPECS.items():
        for seed in range(3):
            engine.add_request(f"{kind}-{seed}", f"Prompt {seed}",
                               SamplingParams(max_tokens=120, temperature=temperature, seed=seed,
                                              structured_outputs=spec))
    events = []
    engine.subscribe(events.append)
    for rid, ((text, _, reason, error),) in finished_texts(engine).items():
        kind = rid.rsplit("-", 1)[0]
        if reason == "length":               # a random model may fill any JSON string to the budget
            assert kind == "json_object", (rid, text)
            continue
        assert reason == "stop" and error is None and matches(kind, text), (rid, text)
    constrained = [e for e in events if isinstance(e, ev.TokenConstrained)]
    sampled = [e for e in events if isinstance(e, ev.TokenSampled)]
    assert len(constrained) == len(sampled) and any(e.forced for e in constrained)
    assert all(e.forced == (e.num_allowed == 1) and e.vocab_size == 257 for e in constrained)


def test_greedy_under_a_grammar_equals_hf_restricted_by_the_same_grammar(tiny_llama, tiny_llama_dir):
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    engine = make_engine(tiny_llama, block_size=4, num_blocks=256)
    prompts = {k: list(range(10 + i, 30 + 3 * i)) for i, k in enumerate(["json", "regex", "grammar"])}
    for kind, prompt in prompts.items():
        engine.add_request(kind, prompt, SamplingParams(max_tokens=40, temperature=0, structured_outputs=SPECS[kind]))
    outs = finished_texts(engine)
    for kind, prompt in prompts.items():
        ids = torch.tensor([prompt])
        allowed = lambda _, row: allowed_after(engine, SPECS[kind], row[len(prompt):].tolist())  # noqa: E731
        with torch.inference_mode():
            gen = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False,
                              prefix_allowed_tokens_fn=allowed, pad_token_id=0)[0, len(prompt):].tolist()
        (_, tokens, reason, _), = outs[kind]
        # The engine stops where the grammar can only end; HF then draws the one token allowed, EOS.
        assert tokens == gen[:len(tokens)] and reason == "stop"
        assert len(gen) == len(tokens) or gen[len(tokens)] == engine.eos_token_id


@pytest.mark.parametrize("width", [2, 3])
def test_beam_search_under_a_grammar_equals_hf(width, tiny_llama, tiny_llama_dir):
    """Every beam owns its matcher, forked with it: the beams equal HF's beams under the same mask."""
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    spec = StructuredOutputsParams(regex=r"[a-m]+( [n-z]+)*")
    engine = make_engine(tiny_llama, block_size=4, num_blocks=256)
    prompt = [7, 99, 45, 3, 200, 17, 64]
    engine.add_request("b", prompt, SamplingParams(beam_width=width, n=width, temperature=0, max_tokens=8,
                                                   min_tokens=8, structured_outputs=spec))
    got = run_to_end(engine)["b"].outputs
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        gen = hf.generate(ids, attention_mask=torch.ones_like(ids), num_beams=width, num_return_sequences=width,
                          do_sample=False, max_new_tokens=8, min_new_tokens=8, pad_token_id=0,
                          prefix_allowed_tokens_fn=lambda _, row: allowed_after(engine, spec, row[len(prompt):].tolist()))
    assert [c.token_ids for c in got] == [row[len(prompt):].tolist() for row in gen]
    assert all(re.fullmatch(r"[a-m]+( [n-z]+)*", c.text) for c in got)


def test_sampling_draws_from_the_masked_renormalised_distribution(tiny_llama):
    """n=64 forks of one prompt, 32 seeds: 2048 first tokens under a 5-way choice vs the exact masked p."""
    spec = StructuredOutputsParams(choice=["apple", "banana", "cherry", "date", "elder"])
    engine = make_engine(tiny_llama, block_size=8, num_blocks=512, max_num_seqs=64)
    params = dict(temperature=0.9, top_k=4, max_tokens=1, n=64, structured_outputs=spec)
    for seed in range(32):
        engine.add_request(f"s{seed}", "Fruit:", SamplingParams(seed=seed, **params))
    counts = torch.zeros(engine.vocab_size)
    for out in run_to_end(engine).values():
        for c in out.outputs:
            counts[c.token_ids[0]] += 1
    probe = make_engine(tiny_llama, block_size=8, num_blocks=64)
    probe.add_request("p", "Fruit:", SamplingParams(max_tokens=1, temperature=0, logprobs=engine.vocab_size))
    row = run_to_end(probe)["p"].outputs[0].logprobs[0]
    logits = torch.tensor([row[t] for t in range(engine.vocab_size)])
    mask = compiler_for(engine.tokenizer, engine.vocab_size, engine.eos_token_id).matcher(spec).next_mask()
    exact = probs(logits[None], [SamplingRow(SamplingParams(temperature=0.9, top_k=4), [], [], None,
                                             engine.eos_token_id, mask)])[0]
    allowed = set(allowed_tokens(mask, engine.vocab_size))
    assert allowed == {ord(c[0]) for c in spec.choice}
    # masked first, then top-k: the 4 best of the 5 allowed, renormalised
    expected = torch.zeros_like(logits)
    best = sorted(allowed, key=lambda t: -float(logits[t]))[:4]
    expected[best] = torch.softmax(logits[best] / 0.9, -1)
    assert torch.allclose(exact, expected, atol=1e-6)
    N = int(counts.sum())
    for t in best:
        p, f = float(expected[t]), float(counts[t]) / N
        assert abs(f - p) < 4 * math.sqrt(p * (1 - p) / N), (t, p, f)
    assert counts[[t for t in range(engine.vocab_size) if t not in best]].sum() == 0
