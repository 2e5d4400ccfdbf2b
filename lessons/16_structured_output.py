"""Lesson 16: structured output, a grammar's mask in every step.

Run it:  python lessons/16_structured_output.py

A request can ask that its output match a JSON schema, a regular expression,
a list of choices or a grammar. The engine compiles the grammar for the
model's vocabulary (xgrammar), and at every step the sequence's matcher says
which tokens may come next: a bitmask over the vocabulary. The sampler sets
every other token's logit to -inf before temperature and top-k, so the token
is drawn from the model's own distribution restricted to the allowed tokens
and renormalised; then the matcher advances over the token. This lesson uses
`tiny-llama`, a random model whose free output is noise: under a grammar even
noise has to parse.
"""

from nanoserve.lesson import breaks, console, say, section  # prose that fits your terminal; --break NAME

BROKEN = breaks({
    "no-renormalise": "in the by-hand distribution, mask the probabilities without renormalising them",
    "mask-after-top-k": "in the by-hand distribution, apply top-k before the grammar's mask",
})

import json  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
from rich import box  # noqa: E402
from rich.table import Table  # noqa: E402

from nanoserve import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from nanoserve import events as ev  # noqa: E402
from nanoserve.sampler import SamplingRow, probs  # noqa: E402
from nanoserve.structured_output import allowed_tokens, compiler_for  # noqa: E402

engine = LLMEngine(EngineConfig(model="tiny-llama", block_size=8, num_blocks=512, max_num_seqs=32))
V = engine.vocab_size                                    # 257: 256 bytes and an end-of-text token
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "age"]}


def run(params: dict, n: int, prompt: str = "Person: ") -> tuple[list, list]:
    """n seeded requests with these SamplingParams fields; (their completions, the events)."""
    events = []
    unsubscribe = engine.subscribe(events.append)
    for seed in range(n):
        engine.add_request(f"r{seed}", prompt, SamplingParams(seed=seed, **params))
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o.outputs[0] for o in engine.step().outputs if o.finished})
    unsubscribe()
    return [done[f"r{seed}"] for seed in range(n)], events


def shown(text: str, width: int = 30) -> str:
    """The first `width` characters, anything but printable ASCII as "?" (random models write any byte)."""
    return "".join(c if " " <= c <= "~" else "?" for c in text[:width])


def parses(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


# ---------------------------------------------------------------------------
section("1. Noise that parses", """
Predict: a random model is asked for a person as JSON, 20 times at temperature 1. How many of its
answers parse as JSON? And with the JSON schema as structured output?
""")
free, _ = run(dict(max_tokens=40, temperature=1.0), 20)
shaped, events = run(dict(max_tokens=120, temperature=1.0, structured_outputs=dict(json=PERSON)), 20)
table = Table("seed", "free text (first 30 characters)", "under the schema", box=box.SIMPLE, pad_edge=False)
for seed in range(4):
    table.add_row(str(seed), shown(free[seed].text), shown(shaped[seed].text, 40))
console.print(table)
n_free, n_shaped = sum(parses(c.text) for c in free), sum(parses(c.text) for c in shaped)
console.print(f"parse as JSON: free {n_free}/20, under the schema {n_shaped}/20")
assert n_free == 0, "random bytes do not make JSON"
assert n_shaped == 20 and all(c.finish_reason == "stop" for c in shaped), "every constrained output parses"
assert all(set(json.loads(c.text)) == {"name", "age"} and 0 <= json.loads(c.text)["age"] <= 99 for c in shaped)
say("""Every constrained answer parses, has exactly the schema's keys, and an age in range: the model
only chose among what the grammar allowed. (Anything but printable ASCII prints as "?" here.) Each
finished with "stop" as soon as the grammar could only end: EOS is allowed exactly where the JSON
is complete, and a grammar with nothing left to add ends the sequence itself.""")

# ---------------------------------------------------------------------------
section("2. How many tokens did the grammar choose?", """
Predict: in '{"name": "', how many tokens could the model choose? Each TokenConstrained event
says how many tokens the mask allowed at that position; "forced" means exactly one.
""")
first = [e for e in events if isinstance(e, ev.TokenConstrained) and e.seq_id == "r0"]
prefix = '{"name": "'
table = Table("token", "allowed", "forced", "model's top choice masked", box=box.SIMPLE, pad_edge=False)
for e in first[:len(prefix) + 2]:
    table.add_row(repr(chr(e.token_id)) if e.token_id < 128 else str(e.token_id), f"{e.num_allowed}",
                  "yes" if e.forced else "", "yes" if e.top_masked else "")
console.print(table)
forced = sum(e.forced for e in first)
console.print(f"r0: {len(first)} tokens, {forced} forced, {sum(e.top_masked for e in first)} with the top "
              "choice masked")
assert [e.forced for e in first[:len(prefix)]] == [True] * len(prefix), "the opening is fixed by the schema"
assert not first[len(prefix)].forced, "the name's first character is the model's choice"
constrained = [e for e in events if isinstance(e, ev.TokenConstrained)]
assert len(constrained) == sum(len(c.token_ids) for c in shaped), "one event per constrained token"
say("""With one character per token (this model's vocabulary is bytes) every byte of the keys and
the punctuation is forced: the grammar leaves one choice. A real tokenizer has multi-character
tokens, and the mask then allows a handful: SmolLM2's vocabulary has '{"' as one token.""")

# ---------------------------------------------------------------------------
section("3. The model's distribution, restricted and renormalised", """
The mask comes after penalties and min_tokens, before temperature, top-k, top-p and min-p. By
hand: mask the logits, divide by the temperature, keep the top-k of what is left, softmax. The
engine's exact distribution (nanoserve.sampler.probs with the row's bitmask) must agree.
""")
spec = dict(choice=["apple", "banana", "cherry", "date", "elderberry"])
probe, _ = run(dict(max_tokens=1, temperature=0, logprobs=V), 1, prompt="Fruit: ")
logits = torch.tensor([probe[0].logprobs[0][t] for t in range(V)])
grammar = compiler_for(engine.tokenizer, V, engine.eos_token_id).matcher(SamplingParams(structured_outputs=spec)
                                                                        .structured_outputs)
mask = grammar.next_mask()                                # [ceil(257 / 32)] = [9] int32
allowed = allowed_tokens(mask, V)
assert allowed == sorted(ord(c[0]) for c in spec["choice"]), "the first letters of the choices"


def by_hand(logits: torch.Tensor, temperature: float, top_k: int) -> torch.Tensor:
    keep = torch.zeros(V, dtype=torch.bool)
    keep[allowed] = True
    x = logits / temperature
    if BROKEN == "mask-after-top-k":
        x = x.masked_fill(x < x.topk(top_k).values[-1], float("-inf"))
        return x.masked_fill(~keep, float("-inf")).softmax(-1)
    if BROKEN == "no-renormalise":
        return x.softmax(-1) * keep
    x = x.masked_fill(~keep, float("-inf"))
    x = x.masked_fill(x < x.topk(top_k).values[-1], float("-inf"))
    return x.softmax(-1)


mine = by_hand(logits, 0.8, 3)
theirs = probs(logits[None], [SamplingRow(SamplingParams(temperature=0.8, top_k=3), [], [], None,
                                          engine.eos_token_id, mask)])[0]
table = Table("token", "model p", "engine p (masked, T=0.8, top-k 3)", box=box.SIMPLE, pad_edge=False)
for t in allowed:
    table.add_row(repr(chr(t)), f"{float(logits.softmax(-1)[t]):.4f}", f"{float(theirs[t]):.4f}")
console.print(table)
assert not mine.isnan().any(), \
    "top-k before the mask kept only tokens the grammar forbids: mask first, then temperature and top-k"
assert abs(float(mine.sum()) - 1) < 1e-5, "a distribution sums to 1: after the mask, renormalise"
assert torch.allclose(mine, theirs, atol=1e-6), \
    "mask first, then temperature and top-k: top-k counts only allowed tokens"
say("""Five tokens are allowed, top-k keeps the 3 best of those, and their probabilities are
renormalised to sum to 1. Top-k before the mask would keep the 3 best of the whole vocabulary,
likely none of them allowed. tests/test_structured_output.py checks the draws against this
distribution, and speculative decoding's output against the masked one, by counting.""")

# ---------------------------------------------------------------------------
section("4. What the mask costs a step", """
Per constrained sequence and step: fill a bitmask from the matcher (xgrammar keeps most masks
precomputed), apply all the batch's masks in one call, advance the matcher at commit. Timed here
for 32 sequences on this machine (benchmarks/bench_structured.py measures it on SmolLM2).
""")
from nanoserve import structured_output as so  # noqa: E402

grammars = [compiler_for(engine.tokenizer, V, engine.eos_token_id).matcher(
    SamplingParams(structured_outputs=dict(json=PERSON)).structured_outputs) for _ in range(32)]
batch = torch.randn(32, V)
t0 = time.perf_counter()
for _ in range(20):
    masks = torch.stack([g.next_mask() for g in grammars])
fill = (time.perf_counter() - t0) / 20
t0 = time.perf_counter()
for _ in range(20):
    masked = so.apply_masks(batch, masks, list(range(32)))
apply = (time.perf_counter() - t0) / 20
console.print(f"fill 32 masks: {1000 * fill:.2f} ms; apply them to [32, {V}] logits: {1000 * apply:.2f} ms")
assert torch.isinf(masked).sum(-1).tolist() == [V - 1] * 32, "at the start of an object only '{' is allowed"
say("""A millisecond or two for the batch, on one core. On SmolLM2's 49,152-token vocabulary the
apply grows with the vocabulary and the fill stays about the same; the benchmarks page has the
measured share of a batch-32 step.""")
