"""Lesson 2: speculative decoding, step by step, and why it is exact.

Run it:  python lessons/02_speculative_decoding.py

A cheap proposer guesses k tokens; the target model scores all of them in one
forward pass over k + 1 positions and keeps the longest prefix it agrees with,
plus one token of its own. Sections 1 and 2 watch a real engine on `tiny-llama`
(random weights) do this through its events; section 3 proves, with exact
fractions, that the acceptance rule (Leviathan et al. 2023, arXiv:2211.17192;
Chen et al. 2023, arXiv:2302.01318) leaves the output distribution unchanged,
and that a plausible-looking variant of its residual does not.
"""

from fractions import Fraction as F

from nanoserve.lesson import breaks, console, say, section  # prose that fits your terminal; --break NAME

BROKEN = breaks({
    "accept-all": "the engine's verify() accepts every draft, whatever the target says",
    "scaled-residual": "on a rejection, sample from max(0, p - q * p(x)/q(x)) instead of max(0, p - q)",
})

import torch  # noqa: E402
from rich import box  # noqa: E402
from rich.table import Table  # noqa: E402

from nanoserve import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from nanoserve.components import Components  # noqa: E402
from nanoserve.events import ChunkScheduled, DraftProposed, DraftVerified, KVTrimmed, TokenSampled  # noqa: E402
from nanoserve.spec_decode import verify  # noqa: E402

PARTS = Components()                   # the engine's own parts (components.py)
if BROKEN == "accept-all":
    def accept_all(p, draft, q, greedy, generator):
        """Wrong on purpose: every draft is kept, then a bonus token."""
        return draft + [int(p[len(draft)].argmax())], len(draft)
    PARTS = Components(verify=accept_all)      # the engine's seam for its acceptance rule

BS = 4                                 # block_size: small, so rejected drafts can free whole blocks
PROMPT = [10, 20, 30, 40, 50] * 4      # token ids: a pattern repeated


def run(params: SamplingParams, **spec) -> tuple[list[int], object, list[dict]]:
    """Run PROMPT alone; return its tokens, its metrics and what each step did (from the events)."""
    engine = LLMEngine(EngineConfig(model="tiny-llama", block_size=BS, num_blocks=64, **spec), components=PARTS)
    engine.add_request("A", PROMPT, params)
    steps, accepted_by_stats = [], 0
    while engine.has_unfinished_requests():
        result = engine.step()
        engine.check_invariants()                  # block tables match the KV that is kept
        accepted_by_stats += result.stats.num_accepted
        row = {"step": result.stats.step, "emitted": []}
        for e in result.events:
            if isinstance(e, DraftProposed):
                row["draft"] = list(e.token_ids)
            elif isinstance(e, ChunkScheduled):
                row["chunk"] = e.num_tokens
            elif isinstance(e, (DraftVerified, KVTrimmed)):
                row[type(e).__name__] = e
            elif isinstance(e, TokenSampled):
                row["emitted"].append(e.token_id)
        steps.append(row)
        if result.outputs and result.outputs[0].finished:
            out = result.outputs[0]
    assert accepted_by_stats == out.metrics.num_accepted, "StepStats and RequestMetrics agree"
    return out.outputs[0].token_ids, out.metrics, steps


def show_steps(steps: list[dict]) -> None:
    table = Table("step", "draft (proposed)", "accepted", "1st rejected", "target's token",
                  "KV dropped", "blocks back", box=box.SIMPLE, pad_edge=False)
    plain = []   # consecutive steps with no draft (prefill, or the proposer found nothing)
    for i, r in enumerate(steps):
        v, t = r.get("DraftVerified"), r.get("KVTrimmed")
        if v is None:
            plain.append(r)
            if i + 1 == len(steps) or "DraftVerified" in steps[i + 1]:
                span = f"{plain[0]['step']}-{r['step']}" if len(plain) > 1 else str(r["step"])
                table.add_row(span, "(none)", "", "", f"{len(plain)} x 1 sampled", "", "")
                plain = []
            continue
        table.add_row(str(r["step"]), str(r["draft"]), f"{v.num_accepted}/{v.num_drafted}",
                      "-" if v.first_rejected < 0 else str(v.first_rejected),
                      f"{'bonus' if v.is_bonus else 'fixed'} {v.token_id}",
                      str(t.num_tokens_dropped), str(list(t.block_ids)) if t.block_ids else "")
        # One forward over the last real token + the drafts, i.e. k + 1 positions.
        assert r["chunk"] == 1 + v.num_drafted
        # The step emits the accepted drafts, then one token chosen by the target.
        assert r["emitted"] == r["draft"][: v.num_accepted] + [v.token_id]
        assert t.num_tokens_dropped == v.num_drafted - v.num_accepted
    console.print(table)


# ---------------------------------------------------------------------------
section("1. N-gram drafts, accepted and rejected", f"""
speculative_method="ngram" (prompt lookup): find the longest suffix of the request's
tokens (1 to 4 tokens) that occurred earlier, and propose the k=4 tokens that followed it.
The engine then runs ONE target forward over the last real token plus the k drafts,
reads k + 1 distributions, and keeps drafts while they match (greedy: the argmax).
At the first mismatch the target's own token replaces the draft ("fixed"); if all k
match, the last position gives a free extra token ("bonus"). The KV written for the
rejected positions is trimmed; blocks past the kept tokens go back to the pool.
Prompt: {PROMPT[:5]} x 4 (token ids), greedy, 32 new tokens, block_size={BS}.
""")
greedy = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
plain, plain_metrics, _ = run(greedy)
spec, metrics, steps = run(greedy, speculative_method="ngram", num_speculative_tokens=4)
show_steps(steps)
per_forward = len(spec) / metrics.num_sampling_steps
console.print(f"without speculation: {plain}")
console.print(f"with n-gram drafts:  {spec}")
say(f"""{len(spec)} tokens in {metrics.num_sampling_steps} target forwards ({per_forward:.2f} per forward, \
{plain_metrics.num_sampling_steps} without); drafts accepted: \
{metrics.num_accepted}/{metrics.num_drafted} = {metrics.acceptance_rate:.2f}.
The random model does not continue the prompt's pattern, but it falls into loops of its
own, and prompt lookup searches the output too: once a loop repeats, drafts are accepted.""")
assert spec == plain, ("greedy speculation must give exactly the tokens of plain greedy decoding: a draft "
                       "may only be kept where it equals the target's argmax")
assert per_forward > 1, "more than one token per target forward"
assert 0 < metrics.num_accepted < metrics.num_drafted, "some drafts accepted, some rejected"
assert any(r.get("KVTrimmed") and r["KVTrimmed"].block_ids for r in steps), "a rejection gave back a block"

# ---------------------------------------------------------------------------
section("2. A draft model, sampling at temperature > 0", """
speculative_method="draft" with draft_model=None runs a truncated copy of the target:
its first layer (draft_num_layers=1), with the target's final norm and head, weights
shared, over its own paged KV cache. It SAMPLES k=3 tokens from its distribution q; the
target computes p at every position and accepts draft x with probability min(1, p(x)/q(x)).
A draft token is accepted with probability sum_x min(p(x), q(x)) = 1 - TV(p, q).
""")
hot = SamplingParams(max_tokens=24, temperature=0.1, seed=0, ignore_eos=True)
draft_spec = dict(speculative_method="draft", draft_num_layers=1, num_speculative_tokens=3)
tokens, metrics, steps = run(hot, **draft_spec)
show_steps(steps)
assert "draft" not in steps[-1], "one token left before max_tokens: nothing to draft"
say(f"""Step 1 is the prefill. Step {steps[-1]['step']} has no draft: a step can emit k + 1 tokens, so
drafts are capped at max_tokens - (tokens so far) - 1, which is 0 there.""")
_, flat, _ = run(SamplingParams(max_tokens=24, temperature=1.0, seed=0, ignore_eos=True), **draft_spec)
console.print(f"temperature 0.1: acceptance {metrics.num_accepted}/{metrics.num_drafted} = "
              f"{metrics.acceptance_rate:.2f}, {len(tokens) / metrics.num_sampling_steps:.2f} tokens per forward")
console.print(f"temperature 1.0: acceptance {flat.num_accepted}/{flat.num_drafted} = {flat.acceptance_rate:.2f}")
say("""With random weights, p and q are nearly flat over the 257 tokens at temperature 1, so they
almost agree. At 0.1 they are sharp, and 1 layer vs 2 layers disagree often. Sampled
tokens differ from a plain run with the same seed (the random draws are used differently),
but their distribution is the same: section 3 shows why.""")
assert 0 < metrics.acceptance_rate < 1, "at temperature > 0 the draft is sometimes rejected"
assert flat.acceptance_rate > metrics.acceptance_rate, "flatter p and q agree more: acceptance rises"
assert any(r.get("DraftVerified") and not r["DraftVerified"].is_bonus for r in steps)

# ---------------------------------------------------------------------------
section("3. Why the rule is exact (and a scaled residual is not)", """
One draft token x ~ q, then the rule. Exactly, with fractions, no sampling:
  P(emit y) = q(y) * min(1, p(y)/q(y))                      x = y was drafted and accepted
            + sum_x q(x) * (1 - min(1, p(x)/q(x))) * r_x(y)   x was rejected, y drawn from r_x
Correct rule:  r_x = normalise(max(0, p - q)), the same for every x.
  Accepting gives y exactly min(p(y), q(y)); the rejected mass is 1 - sum min(p, q)
  = sum max(0, p - q), so the residual adds max(0, p(y) - q(y)); and
  min(p, q) + max(0, p - q) = p. Output = p, whatever q is.
Scaled:        r_x = normalise(max(0, p - q * p(x)/q(x))), which depends on x and adds mass
  to tokens that already got all of theirs from acceptances.
""")
p = [F(2, 10), F(3, 10), F(5, 10)]
q = [F(5, 10), F(4, 10), F(1, 10)]


def output_distribution(residual) -> list[F]:
    """P(emitted token = y) when one draft x ~ q is checked; residual(x) is the unnormalised r_x."""
    out = [F(0)] * 3
    for x in range(3):
        accept = min(F(1), p[x] / q[x])
        out[x] += q[x] * accept
        if accept < 1:                   # (x = 2: p/q = 5, never rejected)
            r = residual(x)
            for y in range(3):
                out[y] += q[x] * (1 - accept) * r[y] / sum(r)
    return out


scaled = output_distribution(lambda x: [max(F(0), p[y] - q[y] * p[x] / q[x]) for y in range(3)])
correct = scaled if BROKEN == "scaled-residual" else \
    output_distribution(lambda x: [max(F(0), p[y] - q[y]) for y in range(3)])
assert correct == p, (f"the rule's output distribution is {[str(c) for c in correct]}, not p = "
                      f"{[str(c) for c in p]}: the residual must be max(0, p - q), the same whichever x was "
                      "rejected, so that acceptance (min(p, q)) plus residual (max(0, p - q)) adds up to p")
assert scaled != p, "the scaled residual does not reproduce p"

# Now the engine's own rule, nanoserve.spec_decode.verify, by sampling.
N, g = 20_000, torch.Generator().manual_seed(0)
P, Q = torch.tensor([0.2, 0.3, 0.5]), torch.tensor([0.5, 0.4, 0.1])
counts = [0, 0, 0]
for _ in range(N):
    x = int(torch.multinomial(Q, 1, generator=g))                  # the draft samples x ~ q
    emitted, _ = verify(torch.stack([P, P]), [x], Q[None], greedy=False, generator=g)  # p: [k+1, V]
    counts[emitted[0]] += 1
sampled = [c / N for c in counts]


def tv(a, b) -> float:
    return 0.5 * sum(abs(float(x) - float(y)) for x, y in zip(a, b))


table = Table("token", "p (target)", "q (draft)", "correct rule", "scaled residual",
              f"verify(), {N} draws", box=box.SIMPLE, pad_edge=False)
for y in range(3):
    table.add_row(str(y), str(p[y]), str(q[y]), str(correct[y]), str(scaled[y]), f"{sampled[y]:.3f}")
table.add_row("TV from p", "", "", f"{tv(correct, p):.3f}", f"{tv(scaled, p):.3f}", f"{tv(sampled, p):.3f}")
console.print(table)
assert tv(sampled, p) < 0.02, "verify() samples from p"
assert tv(scaled, p) > 0.05, "far more than sampling noise: a test at this size catches it"
say("""The scaled residual over-produces token 1 (37/100 instead of 3/10) and under-produces
token 2. tests/test_spec_distribution.py runs the same check on the whole engine.""")
console.print("All checks passed.", style="bold green")
