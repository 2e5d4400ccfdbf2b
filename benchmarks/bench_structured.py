"""Structured output on SmolLM2-135M (CPU): what the grammar's mask costs a decode step, and its promises.

    python benchmarks/bench_structured.py                      # about 5 minutes on 2 cores
    python benchmarks/bench_structured.py --model tiny-llama --seeds 10

Three targets (issue 37), in one process:

1. Mask overhead: 32 requests decode together under a JSON schema. Every
   decode step is timed whole, and inside it the grammar's own work is timed:
   filling each sequence's bitmask from its matcher, applying the masks to the
   batch's logits, counting what they allowed (for the events), and advancing
   the matchers at commit. Target: that work <= 10 % of the step, with events
   off (no subscriber) and on (a subscriber folding every event, as the TUI
   does). The same 32 requests unconstrained run in the same process, so the
   step-time ratio constrained / free is measured too.
2. 100 seeds of sampled JSON-schema output: every output parses and validates.
3. Greedy output under a grammar that allows every text equals unconstrained
   greedy output, token for token.

Times on a shared machine are noisy: compare the ratios within one run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from contextlib import contextmanager

import torch

from nanoserve import EngineConfig, LLMEngine, SamplingParams
from nanoserve import sampler as sampler_module
from nanoserve import structured_output as so
from nanoserve.models.loader import load_model
from nanoserve.trace import fold

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40},
    "born": {"type": "integer", "minimum": 1000, "maximum": 2100},
    "field": {"type": "string", "enum": ["mathematics", "physics", "chemistry", "biology", "computing"]},
    "alive": {"type": "boolean"}}, "required": ["name", "born", "field", "alive"]}
PEOPLE = ["Ada Lovelace", "Alan Turing", "Marie Curie", "Isaac Newton", "Rosalind Franklin", "Grace Hopper",
          "Charles Darwin", "Emmy Noether"]


def machine() -> str:
    name, flags = "unknown", ""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                have = line.split()
                flags = " ".join(f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "amx_tile") if f in have)
                break
    except OSError:
        pass
    return f"{name} ({flags}), torch {torch.__version__}, {torch.get_num_threads()} thread(s)"


def valid(text: str) -> bool:
    """The output parses as JSON and validates against PERSON (checked by hand: no jsonschema needed)."""
    try:
        v = json.loads(text)
    except ValueError:
        return False
    return (isinstance(v, dict) and set(v) == set(PERSON["required"]) and isinstance(v["name"], str)
            and len(v["name"]) <= 40 and type(v["born"]) is int and 1000 <= v["born"] <= 2100
            and v["field"] in PERSON["properties"]["field"]["enum"] and type(v["alive"]) is bool)


class GrammarClock:
    """Seconds spent in the grammar's own work, by wrapping the functions that do it."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._saved = []
        self._depth = 0          # (accept calls next_mask: count the outermost call only)

    @contextmanager
    def installed(self):
        targets = [(so.SequenceGrammar, "next_mask"), (so.SequenceGrammar, "draft_masks"),
                   (so.SequenceGrammar, "accept"), (sampler_module, "apply_grammar"),
                   (so, "mask_info"), (so, "allows_nothing")]
        for owner, name in targets:
            original = getattr(owner, name)
            self._saved.append((owner, name, original))
            setattr(owner, name, self._timed(original))
        try:
            yield self
        finally:
            for owner, name, original in self._saved:
                setattr(owner, name, original)
            self._saved.clear()

    def _timed(self, fn):
        def timed(*args, **kwargs):
            self._depth += 1
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth -= 1
                if not self._depth:
                    self.seconds += time.perf_counter() - t0
        return timed


def chat(tokenizer, text: str) -> str:
    """`text` as a user turn in the model's chat template (as it is, for a model without one)."""
    if not getattr(tokenizer, "chat_template", None):
        return text
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                         add_generation_prompt=True)


def prompts(tokenizer, n: int) -> list[str]:
    return [chat(tokenizer, f"Give {PEOPLE[i % len(PEOPLE)]} as a JSON record: name, year born, field, alive.")
            for i in range(n)]


def decode_steps(loaded, texts, params_of, events: bool, steps: int, clock: GrammarClock | None = None):
    """Run len(texts) requests; time `steps` decode steps once all of them decode. (step s, grammar s) each."""
    engine = LLMEngine(EngineConfig(model=loaded.name, block_size=16, num_blocks=400, max_num_seqs=len(texts),
                                    max_num_batched_tokens=4096), loaded=loaded)
    if events:
        state = [None]
        engine.subscribe(lambda e: state.__setitem__(0, fold(state[0], e)))
    for i, t in enumerate(texts):
        engine.add_request(str(i), t, params_of(i))
    while any(s.num_output_tokens == 0 for s in engine.sequences.values()):   # prefill (not timed)
        engine.step()
    rows = []
    for _ in range(steps):
        if len(engine.sequences) < len(texts):      # someone finished: the batch is no longer 32
            break
        g0 = clock.seconds if clock else 0.0
        t0 = time.perf_counter()
        engine.step()
        rows.append((time.perf_counter() - t0, (clock.seconds - g0) if clock else 0.0))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=12, help="decode steps timed per run")
    ap.add_argument("--rounds", type=int, default=2, help="runs of each kind, interleaved")
    ap.add_argument("--seeds", type=int, default=100)
    args = ap.parse_args()
    print(f"machine: {machine()}")
    loaded = load_model(args.model)
    texts = prompts(loaded.tokenizer, args.batch)
    schema = SamplingParams(max_tokens=96, temperature=0, structured_outputs=dict(json=PERSON))
    free = SamplingParams(max_tokens=96, temperature=0, min_tokens=40)   # (decodes as long)

    print(f"\n1. mask overhead: batch {args.batch}, {args.steps} decode steps per run, {args.rounds} rounds")
    clock = GrammarClock()
    results = {}
    for _ in range(args.rounds):
        for events in (False, True):
            with clock.installed():
                results.setdefault(("json", events), []).extend(
                    decode_steps(loaded, texts, lambda i: schema, events, args.steps, clock))
            results.setdefault(("free", events), []).extend(
                decode_steps(loaded, texts, lambda i: free, events, args.steps))
    for events in (False, True):
        json_rows, free_rows = results[("json", events)], results[("free", events)]
        step = statistics.median(s for s, _ in json_rows)
        share = statistics.median(g / s for s, g in json_rows)
        ratio = step / statistics.median(s for s, _ in free_rows)
        print(f"   events {'on ' if events else 'off'}: constrained step {1000 * step:.1f} ms (median of "
              f"{len(json_rows)}), grammar work {100 * share:.1f} % of it (median per step); "
              f"constrained / free step time {ratio:.2f}x")

    print(f"\n2. {args.seeds} seeds of sampled JSON (temperature 1): parse and validate")
    engine = LLMEngine(EngineConfig(model=loaded.name, block_size=16, num_blocks=512, max_num_seqs=args.batch,
                                    max_num_batched_tokens=4096), loaded=loaded)
    for seed in range(args.seeds):
        engine.add_request(str(seed), texts[seed % len(texts)],
                           SamplingParams(max_tokens=160, temperature=1.0, seed=seed,
                                          structured_outputs=dict(json=PERSON)))
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o.outputs[0] for o in engine.step().outputs if o.finished})
    ok = sum(valid(c.text) for c in outs.values())
    reasons = statistics.multimode(c.finish_reason for c in outs.values())
    print(f"   {ok}/{len(outs)} parse and validate (finish reasons: {reasons}); e.g. {outs['0'].text}")

    print("\n3. greedy under a grammar that allows every text == unconstrained greedy")
    anything = SamplingParams(max_tokens=64, temperature=0, structured_outputs=dict(regex=r"[\s\S]*"))
    plain = SamplingParams(max_tokens=64, temperature=0)
    engine = LLMEngine(EngineConfig(model=loaded.name, block_size=16, num_blocks=256), loaded=loaded)
    questions = ["What is a KV cache?", "Name three colours.", "Write a haiku about the sea.", "What is 17 * 3?"]
    for i, q in enumerate(questions):
        text = chat(loaded.tokenizer, q)
        engine.add_request(f"a{i}", text, anything)
        engine.add_request(f"p{i}", text, plain)
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o.outputs[0].token_ids for o in engine.step().outputs if o.finished})
    same = sum(outs[f"a{i}"] == outs[f"p{i}"] for i in range(len(questions)))
    print(f"   {same}/{len(questions)} prompts: the same tokens ({sum(len(outs[f'p{i}']) for i in range(len(questions)))}"
          " tokens in all)")


if __name__ == "__main__":
    main()
