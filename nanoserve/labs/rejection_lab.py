"""Lab rejection-sampling: speculative decoding's exact acceptance rule (`spec_decode.verify`).

The student writes `verify(p, draft, q, greedy, generator)`. The checks are
distributions, not examples: thousands of seeded calls, and the tokens
`verify` emits must follow the target distribution p, measured by total
variation distance against the exact probabilities. Then the real engine
runs n-gram speculative decoding with the student's rule and must produce
the same greedy tokens as the engine's own.
"""

from __future__ import annotations

import torch

from nanoserve.components import Components
from nanoserve.labs.common import SIGNATURES
from nanoserve.labs.drive import same_as_engine
from nanoserve.labs.lab import Check, CheckFailed, Context, Lab, expect

TRIALS = 4000
TOLERANCE = 0.05    # total variation; sampling noise at 4000 draws over <= 5 tokens is about 0.015

INTRO = """Lab rejection-sampling: speculative decoding's acceptance rule, exact.

A proposer guessed `draft` (k tokens). The target model scored every position
in one forward: p[i] is the target's distribution at draft position i, and
p[k] the one after the last draft token. q[i] is the draft's distribution
(None for an n-gram draft, which is one-hot at its token). Write `verify` so
that the tokens it returns are distributed EXACTLY as if sampled from p:

    for i, x in enumerate(draft):
        accept x with probability min(1, p_i(x) / q_i(x))
        on the first rejection: emit a token from normalise(max(0, p_i - q_i)); stop
    if all k were accepted: emit a bonus token from p_k

Greedy requests accept while the draft equals argmax p_i and then emit the argmax.
Draw every random number from `generator` (torch.rand(..., generator=generator),
torch.multinomial(..., generator=generator)) so a seeded request is reproducible.
Leviathan et al. 2023 (arXiv:2211.17192), Chen et al. 2023 (arXiv:2302.01318).
"""

P = torch.tensor([0.45, 0.3, 0.15, 0.1])
Q = torch.tensor([0.1, 0.2, 0.6, 0.1])


def _tv(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * float((a - b).abs().sum())


def generator(seed: int) -> torch.Generator:
    """A seeded generator (run in the worker: the student's verify draws from it there, nothing crosses)."""
    return torch.Generator().manual_seed(seed)


def reseed_global(seed: int) -> None:
    """Reseed the worker's global RNG (a verify that ignores `generator` then gives other tokens)."""
    torch.manual_seed(seed)


def _gen(ctx: Context | None, seed: int):
    return ctx.helper("nanoserve.labs.rejection_lab:generator", seed) if ctx is not None and ctx.helper \
        else generator(seed)


def _first_tokens(verify, p, q_row, trials: int, seed: int, draft_from_q: bool, fixed: int = 0,
                  ctx: Context | None = None) -> torch.Tensor:
    """Frequencies of the first emitted token over `trials` seeded calls with a 1-token draft."""
    gen, drafts = _gen(ctx, seed), torch.Generator().manual_seed(seed + 1)
    counts = torch.zeros(p.shape[-1])
    for _ in range(trials):
        x = int(torch.multinomial(q_row, 1, generator=drafts)) if draft_from_q else fixed
        tokens, _ = verify(p, [x], q_row[None] if draft_from_q else None, False, gen)
        counts[tokens[0]] += 1
    return counts / trials


def _scaled_residual_law(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The output law of the tempting mistake: on rejection, draw from max(0, p - q * p(x)/q(x))."""
    out = torch.zeros_like(p)
    for x in range(len(p)):
        accept = min(1.0, float(p[x] / q[x]))
        out[x] += q[x] * accept
        r = (p - q * p[x] / q[x]).clamp_min(0)
        if r.sum() > 0 and accept < 1:
            out += q[x] * (1 - accept) * r / r.sum()
    return out


def _pair(got) -> tuple:
    """A verify result as (list of ints, int), whatever sequence type it came in."""
    if not (isinstance(got, (tuple, list)) and len(got) == 2):
        raise CheckFailed(f"verify returned {got!r}, expected (tokens, number accepted)",
                          "return a pair: the list of tokens to append, and how many drafts were accepted")
    return [int(t) for t in got[0]], int(got[1])


def greedy_rule(ctx: Context) -> None:
    verify = ctx.module.verify
    p = torch.tensor([[0.1, 0.7, 0.2], [0.6, 0.3, 0.1], [0.2, 0.2, 0.6]])
    for draft, want, why in (([1, 0], ([1, 0, 2], 2), "when all k drafts are accepted, emit a bonus token from "
                                                      "p[k] (greedy: its argmax)"),
                             ([1, 2], ([1, 0], 1), "greedy: accept while the draft is the argmax; then emit the "
                                                   "argmax and stop"),
                             ([2, 0], ([1], 0), "greedy: a first draft that is not the argmax is rejected at once: "
                                                "emit the argmax of p[0]"),
                             ([], ([1], 0), "no draft: just the bonus token from p[0]")):
        for seed in range(8):   # the answer may not depend on a generator (a rule that samples here would)
            got = _pair(verify(p[: len(draft) + 1], draft, None, True, torch.Generator().manual_seed(seed)))
            expect(got == want, f"greedy, draft {draft} against argmaxes [1, 0, 2]: got {got}, expected {want}",
                   why)


def onehot_law(ctx: Context) -> None:
    p = torch.stack([P, P])
    freq = _first_tokens(ctx.module.verify, p, torch.eye(4)[0], TRIALS, 1, draft_from_q=False, fixed=0, ctx=ctx)
    tv = _tv(freq, P)
    if tv > TOLERANCE:
        hint = None
        from_p = P.clone()                        # the law when a rejection draws from p, x included
        from_p[0] = P[0] + (1 - P[0]) * P[0]
        from_p[1:] = (1 - P[0]) * P[1:]
        if _tv(freq, from_p) < TOLERANCE:
            hint = ("after rejecting x you drew from p itself, which can give x again: the residual "
                    "normalise(max(0, p - q)) with q one-hot at x is p with x removed")
        raise CheckFailed(f"n-gram draft always token 0: first tokens {_fmt(freq)}, target p {_fmt(P)} "
                          f"(total variation {tv:.3f})", hint)


def draft_law(ctx: Context) -> None:
    p = torch.stack([P, P])
    freq = _first_tokens(ctx.module.verify, p, Q, TRIALS, 2, draft_from_q=True, ctx=ctx)
    tv = _tv(freq, P)
    if tv > TOLERANCE:
        bad = _scaled_residual_law(P, Q)
        hint = None
        if _tv(freq, bad) < TOLERANCE:
            hint = ("your residual looks like max(0, p - q·p(x)/q(x)): the residual is normalise(max(0, p - q)), "
                    "the target's mass that the draft under-proposes, whatever x was")
        raise CheckFailed(f"draft tokens from q {_fmt(Q)}: first tokens {_fmt(freq)}, target p {_fmt(P)} "
                          f"(total variation {tv:.3f})", hint)


def bonus_law(ctx: Context) -> None:
    p = torch.stack([torch.eye(4)[2], P])     # the draft token 2 is certain under p: always accepted
    gen, verify = _gen(ctx, 3), ctx.module.verify
    counts = torch.zeros(4)
    for _ in range(TRIALS):
        tokens, accepted = _pair(verify(p, [2], None, False, gen))
        expect(len(tokens) == 2 and accepted == 1 and tokens[0] == 2,
               f"a draft token with p = 1 gave {tokens}, {accepted} accepted; expected [2, bonus], 1",
               "when all k drafts are accepted, emit a bonus token sampled from p[k] and return k accepted")
        counts[tokens[1]] += 1
    tv = _tv(counts / TRIALS, P)
    expect(tv <= TOLERANCE, f"bonus tokens {_fmt(counts / TRIALS)}, p[k] {_fmt(P)} (total variation {tv:.3f})",
           "the bonus token is sampled from p[k], the row after the last draft token")


def accepted_law(ctx: Context) -> None:
    """Two n-gram draft tokens: how many are accepted follows p, and the tokens start with the accepted drafts."""
    p = torch.stack([P, P, P])
    gen, verify = _gen(ctx, 4), ctx.module.verify
    counts = torch.zeros(3)
    for _ in range(TRIALS // 2):
        tokens, accepted = _pair(verify(p, [0, 0], None, False, gen))
        expect(0 <= accepted <= 2 and len(tokens) == accepted + 1 and tokens[:accepted] == [0] * accepted,
               f"draft [0, 0] gave tokens {tokens} with {accepted} accepted",
               "return the accepted drafts, then exactly one more token (corrected or bonus), and how many drafts "
               "were accepted")
        counts[accepted] += 1
    a = float(P[0])
    want = torch.tensor([1 - a, a * (1 - a), a * a])
    tv = _tv(counts / counts.sum(), want)
    expect(tv <= TOLERANCE, f"draft [0, 0] with p(0) = {a:.2f} at both positions: accepted 0/1/2 drafts "
           f"{_fmt(counts / counts.sum())}, expected {_fmt(want)} (total variation {tv:.3f})",
           "each draft token is accepted with probability min(1, p_i(x)/q_i(x)) in turn, and the first rejection "
           "ends the loop; after an acceptance go on with the next position")


def reproducible(ctx: Context) -> None:
    """The same generator state gives the same tokens, whatever the global RNG does in between."""
    p = torch.stack([P, P, P])
    runs, verify, q = [], ctx.module.verify, Q[None].repeat(2, 1)
    for global_seed in (1, 2):
        ctx.helper("nanoserve.labs.rejection_lab:reseed_global", global_seed)
        gen = _gen(ctx, 11)
        runs.append([tuple(_pair(verify(p, [1, 2], q, False, gen))[0]) for _ in range(60)])
    expect(runs[0] == runs[1], "two runs from the same generator seed gave different tokens once the global RNG "
           "was reseeded", "draw every random number from `generator` (torch.rand(..., generator=generator), "
                           "torch.multinomial(..., generator=generator)): a seeded request must repeat exactly")
    expect(len(set(runs[0])) > 1, "60 calls on one generator gave the same tokens every time",
           "each call draws new random numbers from the generator (it advances)")


def engine_runs(ctx: Context) -> None:
    from nanoserve.sampling_params import SamplingParams
    loop = [11, 12, 13, 14, 15] * 3                      # repeated text: the n-gram proposer has guesses
    reqs = [("a", loop, SamplingParams(max_tokens=16, temperature=0)),
            ("b", [7, 8, 9] * 4, SamplingParams(max_tokens=12, temperature=0)),
            ("c", loop[:8], SamplingParams(max_tokens=10, temperature=0.8, seed=4))]
    same_as_engine(ctx, reqs, {"num_blocks": 48, "speculative_method": "ngram", "num_speculative_tokens": 3},
                   "with your rule the engine's tokens differ from the engine's own: check the greedy rule, the "
                   "number accepted you return, and that every random draw uses `generator`")


def _fmt(t: torch.Tensor) -> str:
    return "[" + ", ".join(f"{float(x):.2f}" for x in t) + "]"


LAB = Lab(
    name="rejection-sampling",
    title="speculative decoding: exact rejection sampling (accept, residual, bonus)",
    module="nanoserve.spec_decode",
    keep=("verify",),
    starter_name="rejection.py",
    intro=INTRO,
    blanks={"verify": "move p and q to the CPU; loop over the draft (greedy: compare with argmax; else accept "
                      "when u * q(x) < p(x)); on a rejection draw from the normalised residual and return; "
                      "after the loop append the bonus token from p[k]"},
    contracts={"verify": "Returns (the accepted prefix of `draft` plus one more token, the number accepted) "
                         "such that the tokens are distributed exactly as sampling from p would give: draft "
                         "token i is accepted with probability min(1, p_i(x)/q_i(x)) (q None: one-hot at x); "
                         "the first rejection emits a token from normalise(max(0, p_i - q_i)) and stops; when "
                         "all are accepted a bonus token comes from p[k]. Greedy: accept while the draft is "
                         "argmax p_i, then emit the argmax. Every random number comes from `generator`."},
    invariants="len(tokens) == accepted + 1 and tokens[:accepted] == draft[:accepted]; the output law equals "
               "p's, whatever q is (Leviathan et al. 2023, Theorem 1).",
    worker_imports=("nanoserve.labs.rejection_lab",),
    components=lambda m: Components(verify=m.verify),
    checks=(
        SIGNATURES,
        Check("verify: greedy accepts while argmax, then the argmax", greedy_rule,
              "greedy: accept while the draft is the argmax; then emit the argmax and stop", 30, function="verify"),
        Check("verify: n-gram draft, output distributed as p", onehot_law,
              "accept x with probability min(1, p(x)/q(x)); on rejection draw from normalise(max(0, p - q)); "
              "with q one-hot at x that is p with x removed", 120, function="verify"),
        Check("verify: draft model, output distributed as p", draft_law,
              "accept x with probability min(1, p(x)/q(x)), i.e. when u * q(x) < p(x); on rejection draw from "
              "normalise(max(0, p - q))", 120, function="verify"),
        Check("verify: all accepted, a bonus token from p[k]", bonus_law,
              "when all k drafts are accepted, emit a bonus token sampled from p[k]", 120, function="verify"),
        Check("verify: two drafts, accepted as often as p says", accepted_law,
              "accept each draft in turn; stop at the first rejection", 120, function="verify"),
        Check("verify: every draw from the generator", reproducible,
              "draw every random number from `generator`", 60, function="verify"),
        Check("real engine: n-gram speculation, same tokens", engine_runs,
              "run the engine with speculative_method='ngram' and your verify", 240),
    ),
    why=(
        ("Why is the residual normalise(max(0, p - q)), whatever the rejected token was?",
         "Accepting gives token y with probability min(q(y), p(y)). What p still owes y is p(y) - min(q(y), "
         "p(y)) = max(0, p(y) - q(y)), and the total owed is exactly the rejection probability; drawing the "
         "correction from that normalised difference pays every token its debt, so the output is p exactly."),
        ("Why can a greedy request skip the random numbers entirely?",
         "Greedy sampling is p with all mass on its argmax: min(1, p(x)/q(x)) is 1 when x is the argmax and 0 "
         "otherwise, and the residual puts everything on the argmax. The rule degenerates to comparing with "
         "argmax, and the output equals plain greedy decoding token for token."),
        ("Why must every draw come from the request's own generator?",
         "A seeded request must give the same tokens on every run, whatever else the batch holds. The global RNG "
         "is shared by all requests (and the engine's other parts): its state depends on what ran before."),
    ),
    prerequisites="probability (rejection sampling); lesson 2 (speculative decoding)",
    minutes=45,
)
