"""Lesson 7: sampling, checked by distribution.

Run it:  python lessons/07_sampling.py

The sampler turns one row of logits into a token: penalties, temperature,
top-k, top-p, min-p, then a draw from the request's own random generator.
Sampling is random, so "it looks right" proves nothing: this lesson rebuilds
each step by hand from a real row of `tiny-llama`'s logits, compares it with
the engine's exact distribution (`nanoserve.sampler.probs`), and then checks
that the tokens the engine really draws follow that distribution, within the
noise a sample of that size must have.
"""

from nanoserve.lesson import breaks, console, say, section  # prose that fits your terminal; --break NAME

BROKEN = breaks({
    "top-p-drops-crossing": "in the by-hand top-p, drop the token whose mass crosses top_p",
    "temperature-on-probs": "in the by-hand pipeline, divide probabilities by the temperature, not logits",
})

import math  # noqa: E402

import torch  # noqa: E402
from rich import box  # noqa: E402
from rich.table import Table  # noqa: E402

from nanoserve import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from nanoserve.sampler import SamplingRow, apply_penalties, probs  # noqa: E402

PROMPT = "The sampler picks"
engine = LLMEngine(EngineConfig(model="tiny-llama", block_size=8, num_blocks=256, max_num_seqs=64))
V = engine.vocab_size                                    # 257: 256 bytes and an end-of-text token


def first_token_logprobs() -> torch.Tensor:
    """The model's raw log-probabilities [V] for the token after PROMPT, from the engine itself."""
    engine.add_request("probe", PROMPT, SamplingParams(max_tokens=1, temperature=0, logprobs=V))
    while engine.has_unfinished_requests():
        out = engine.step().outputs
    row = out[0].outputs[0].logprobs[0]                  # {token_id: logprob} for all V tokens
    return torch.tensor([row[t] for t in range(V)])


def engine_probs(logits: torch.Tensor, params: SamplingParams, output=(), prompt=()) -> torch.Tensor:
    """The exact distribution the engine draws from for this row and these settings."""
    row = SamplingRow(params, list(prompt), list(output), None, engine.eos_token_id)
    return probs(logits[None], [row])[0]


# ---------------------------------------------------------------------------
section("1. The pipeline, by hand", """
Raw logits -> divide by the temperature -> keep the top_k largest -> keep the smallest set of
the most likely tokens whose mass reaches top_p (the token that crosses top_p is kept) ->
drop tokens below min_p times the top probability -> softmax. Each step below is written in
a few lines of torch and compared with the engine's own distribution for the same settings.
A log-probability row is the logits up to a constant, which none of these steps sees.
""")
logits = first_token_logprobs()


def by_hand(logits: torch.Tensor, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) -> torch.Tensor:
    if BROKEN == "temperature-on-probs":
        x = logits.softmax(-1) / temperature     # wrong: temperature reshapes the logits, not the probs
        x = x.log()
    else:
        x = logits / temperature
    if top_k:
        kth = x.topk(top_k).values[-1]
        x = x.masked_fill(x < kth, -math.inf)
    if top_p < 1.0:
        p, order = x.softmax(-1).sort(descending=True)
        before = p.cumsum(-1) - p                # mass of the tokens ranked above each one
        drop = (before + p > top_p) if BROKEN == "top-p-drops-crossing" else (before >= top_p)
        x = x.clone()
        x[order[drop]] = -math.inf
    if min_p:
        p = x.softmax(-1)
        x = x.masked_fill(p < min_p * p.max(), -math.inf)
    return x.softmax(-1)


table = Table("settings", "tokens kept", "top token p", "max |by hand - engine|", box=box.SIMPLE, pad_edge=False)
cases = [dict(temperature=1.0), dict(temperature=0.5), dict(temperature=2.0), dict(temperature=1.0, top_k=5),
         dict(temperature=1.0, top_p=0.1), dict(temperature=0.7, top_k=50, top_p=0.3),
         dict(temperature=1.0, min_p=0.9)]
for case in cases:
    mine, theirs = by_hand(logits, **case), engine_probs(logits, SamplingParams(**case))
    diff = float((mine - theirs).abs().max())
    table.add_row(", ".join(f"{k}={v}" for k, v in case.items()), str(int((theirs > 0).sum())),
                  f"{float(theirs.max()):.4f}", f"{diff:.1e}")
    why = ("top-p keeps the token whose mass crosses top_p: a token is dropped only when the tokens "
           "ranked above it already reach top_p" if "top_p" in case else
           "temperature divides the logits, before the softmax: softmax(logits / T), not softmax(logits) / T")
    assert diff < 1e-6, f"by hand and the engine disagree for {case} (max difference {diff:.3f}): {why}"
console.print(table)
greedy = engine_probs(logits, SamplingParams(temperature=0))
assert greedy[logits.argmax()] == 1.0, "temperature 0 is greedy: all the mass on the argmax"
assert float(engine_probs(logits, SamplingParams()).max()) < 0.05, "random weights: a nearly flat row"
say("""Temperature 0 is greedy: the engine's distribution puts all its mass on the argmax. Random
weights give a nearly flat row (the most likely token has under 5%), so top-p needs many tokens to
reach its mass; lesson 12 looks at a trained model.""")

# ---------------------------------------------------------------------------
section("2. Checked by distribution: what the engine really draws", """
An exact distribution is half the story: the engine must also draw from it. One request with
n=64 computes its prompt once and forks 64 ways; the 64 sequences draw their first token from
the same logits row, each with its own generator. 32 such requests (seeds 0..31) give 2048
draws at temperature 0.8, top_k=5. Their frequencies must match the exact probabilities to
within sampling noise: for a token of probability p, N draws have a standard error of
sqrt(p (1 - p) / N). We allow 4 standard errors per token.
""")
params = dict(temperature=0.8, top_k=5, max_tokens=1, n=64, ignore_eos=True)
counts = torch.zeros(V)
for seed in range(32):
    engine.add_request(f"s{seed}", PROMPT, SamplingParams(seed=seed, **params))
while engine.has_unfinished_requests():
    for out in engine.step().outputs:
        if out.finished:
            for c in out.outputs:
                counts[c.token_ids[0]] += 1
N = int(counts.sum())
exact = engine_probs(logits, SamplingParams(temperature=0.8, top_k=5))
table = Table("token", "exact p", "observed", "std error", "|diff| / std error", box=box.SIMPLE, pad_edge=False)
for t in exact.nonzero().flatten().tolist():
    p, f = float(exact[t]), float(counts[t]) / N
    se = math.sqrt(p * (1 - p) / N)
    table.add_row(str(t), f"{p:.4f}", f"{f:.4f}", f"{se:.4f}", f"{abs(f - p) / se:.2f}")
    assert abs(f - p) < 4 * se, f"token {t}: observed {f:.4f}, exact {p:.4f}: more than 4 standard errors apart"
console.print(table)
assert N == 2048 and counts[exact == 0].sum() == 0, "every draw is one of the top 5 tokens"
tv = 0.5 * float((counts / N - exact).abs().sum())
console.print(f"{N} draws, total variation distance from the exact distribution: {tv:.4f}")
say("""No draw fell outside the top 5, and every frequency is within 4 standard errors of its exact
probability: the draw is right, not just the distribution. tests/test_sampler.py and
tests/test_spec_distribution.py make the same kind of check, in more settings.""")

# ---------------------------------------------------------------------------
section("3. Penalties", """
Penalties change the logits before everything else, from the tokens a request has seen:
repetition_penalty (Hugging Face) divides the positive logits and multiplies the negative
ones of every token in the prompt or the output; frequency_penalty subtracts penalty x count
of each generated token; presence_penalty subtracts a flat amount once a token was generated.
""")
row = torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0])
prompt_ids, output_ids = [4], [0, 0, 3]                     # token 0 generated twice, token 3 once
rep, freq, pres = 1.5, 0.4, 0.3
params = SamplingParams(repetition_penalty=rep, frequency_penalty=freq, presence_penalty=pres)
engine_row = apply_penalties(row[None], [SamplingRow(params, prompt_ids, output_ids, None, None)])[0]
count = torch.tensor([output_ids.count(t) for t in range(5)], dtype=torch.float)
seen = torch.tensor([t in prompt_ids or t in output_ids for t in range(5)])
hand = torch.where(seen, torch.where(row > 0, row / rep, row * rep), row) - freq * count - pres * (count > 0)
for t in range(5):
    console.print(f"  token {t}: logit {row[t]:+.2f}, seen {bool(seen[t])!s:5}, generated {int(count[t])}x "
                  f"-> {engine_row[t]:+.3f}")
assert torch.allclose(engine_row, hand), "the penalties, by hand, match the engine's"
say("""Token 4 was only in the prompt: repetition_penalty counts it (it multiplies its negative logit),
frequency and presence do not. Token 0, generated twice, pays the frequency penalty twice.""")

# ---------------------------------------------------------------------------
section("4. Per-request seeds, and min_tokens", """
A seeded request draws from its own generator, so it gets the same tokens whatever else is in
the batch. min_tokens masks the end-of-text token (and stop_token_ids) until that many tokens
are out.
""")


def run_alone_or_not(with_company: bool, seed: int) -> list[int]:
    eng = LLMEngine(EngineConfig(model="tiny-llama", block_size=8, num_blocks=64))
    if with_company:
        for i in range(3):
            eng.add_request(f"other{i}", f"Other request {i}", SamplingParams(max_tokens=8, temperature=1.0))
    eng.add_request("me", PROMPT, SamplingParams(max_tokens=8, temperature=1.0, seed=seed, ignore_eos=True))
    tokens = {}
    while eng.has_unfinished_requests():
        for out in eng.step().outputs:
            tokens[out.request_id] = out.outputs[0].token_ids
    return tokens["me"]


alone, crowded, other_seed = run_alone_or_not(False, 7), run_alone_or_not(True, 7), run_alone_or_not(False, 8)
console.print(f"  seed 7 alone:          {alone}")
console.print(f"  seed 7 with 3 others:  {crowded}")
console.print(f"  seed 8 alone:          {other_seed}")
assert alone == crowded, "a seeded request's tokens do not depend on its batch"
assert alone != other_seed, "another seed, other tokens"
eos = engine.eos_token_id
masked = engine_probs(logits, SamplingParams(min_tokens=3), output=[1, 2])[eos]
unmasked = engine_probs(logits, SamplingParams(min_tokens=3), output=[1, 2, 3])[eos]
assert masked == 0 < unmasked, "min_tokens masks end-of-text until that many tokens are out"
console.print(f"min_tokens=3: p(end of text) = {float(masked)} after 2 tokens, {float(unmasked):.4f} after 3.")
console.print("All checks passed.", style="bold green")
