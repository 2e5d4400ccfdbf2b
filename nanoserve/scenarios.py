"""Scenarios: small, repeatable workloads that make one mechanism happen on screen.

A scenario is an engine config plus a list of requests, each arriving at a
given step, so continuous batching has something to do. `ScenarioRunner`
feeds the arrivals and steps the engine; `record()` writes the events of a
whole run to a JSONL trace that the TUI, the Graphviz exporter and the
lessons replay without a model.

    nanoserve record --scenario memory-pressure -o pressure.jsonl
    nanoserve record --scenario memory-pressure --model smollm2 -o pressure.jsonl

Each scenario comes in two workloads, and the model decides which one runs:

* `plain`, for any model, and the one the random tiny models (`tiny-llama`,
  the default) run: short byte-level prompts, EOS ignored (random weights
  may emit it at once). A scenario is about the engine's decisions, not the
  text, so this is enough to see every mechanism, instantly and offline.
* `chat`, for a model with a chat template (`smollm2`): real conversations
  formatted with the model's own template, greedy and EOS honoured, so the
  text reads well on a projector, with sizes chosen so the mechanism still
  shows (a system prompt long enough to fill cached blocks, text the n-gram
  proposer can copy, a pool small enough to preempt). `tests/test_scenarios.py`
  checks every mechanism on both.

This module imports no torch until a runner is built, so the command line
can list the scenarios instantly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

Message = dict          # {"role": "system" | "user" | "assistant", "content": str}


@dataclass(slots=True)
class Arrival:
    step: int                  # added just before this step runs (0: before the first)
    request_id: str
    prompt: str | list[int] | list[Message]   # text, token ids, or (chat workloads) messages
    params: dict = field(default_factory=dict)   # SamplingParams fields


@dataclass(slots=True)
class Workload:
    config: dict               # EngineConfig fields (model excluded)
    arrivals: list[Arrival]


@dataclass(slots=True)
class Scenario:
    name: str
    description: str           # one line: what to watch for
    config: dict               # the plain workload's EngineConfig fields (model excluded)
    arrivals: list[Arrival]    # the plain workload's requests
    chat: Workload | None = None   # the workload for a model with a chat template (None: plain everywhere)
    model: str | None = None   # the model it needs whatever is asked for (a sliding window: tiny-gemma3); None: any

    def workload(self, chat_model: bool) -> Workload:
        """The workload to run: `chat` on a model with a chat template (when there is one), else plain."""
        return self.chat if chat_model and self.chat is not None else Workload(self.config, self.arrivals)


def user(text: str, system: str | None = None) -> list[Message]:
    """One user turn (after a system prompt, if given): a chat workload's prompt."""
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]


# -- plain prompts (tiny random models) ----------------------------------------------
SYSTEM = "You are a helpful assistant. Answer briefly and politely. "
TEXT = "The quick brown fox jumps over the lazy dog. "

# -- chat prompts (smollm2) ----------------------------------------------------------
TEACHER = ("You are a patient teacher in a class about how language models are served. Answer every question "
           "in one or two short sentences of plain English, with no lists and no code.")
ARTICLE = ("A serving engine keeps the keys and values of every token it has seen in a cache, so that each new "
           "token only needs one step of attention instead of recomputing the whole prompt. The cache is cut "
           "into fixed-size blocks, and each request has a table that maps its positions to blocks, like the "
           "pages of an operating system. When memory runs out, the engine pauses a request, frees its blocks "
           "and computes them again later.")
# text to copy: the answer repeats the prompt, so n-gram lookup in the prompt guesses right
PROVERBS = ("The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single "
            "step.")
PAGED = ("A serving engine keeps the keys and values of every token in a cache. The cache is cut into blocks. "
         "Each request has a block table.")
GREEDY = dict(temperature=0)
# structured output: what a class can check by eye (a JSON record, a choice, a date)
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                           "born": {"type": "integer", "minimum": 1000, "maximum": 2100},
                                           "city": {"type": "string", "maxLength": 16}},
          "required": ["name", "born", "city"]}
DATE = r"[0-9]{4}-[0-9]{2}-[0-9]{2}"

SCENARIOS: dict[str, Scenario] = {s.name: s for s in [
    Scenario(
        "continuous-batching",
        "Requests arrive while others decode; a finished one frees its seat for the next at once.",
        dict(block_size=4, num_blocks=64, max_num_batched_tokens=32, max_num_seqs=4),
        [Arrival(0, "r1", "Hello there!", dict(max_tokens=12)),
         Arrival(0, "r2", "Paged attention", dict(max_tokens=6)),
         Arrival(2, "r3", "Continuous batching", dict(max_tokens=10)),
         Arrival(4, "r4", "Blocks and tables", dict(max_tokens=8)),
         Arrival(5, "r5", "One more request", dict(max_tokens=8)),
         Arrival(7, "r6", "Late arrival", dict(max_tokens=6))],
        Workload(dict(block_size=8, num_blocks=96, max_num_batched_tokens=128, max_num_seqs=4),
                 [Arrival(0, "r1", user("What is the capital of France?"), dict(GREEDY, max_tokens=24)),
                  Arrival(0, "r2", user("Say hello in Spanish."), dict(GREEDY, max_tokens=12)),
                  Arrival(2, "r3", user("Name three colours."), dict(GREEDY, max_tokens=16)),
                  Arrival(4, "r4", user("What is the opposite of hot?"), dict(GREEDY, max_tokens=16)),
                  Arrival(5, "r5", user("What do cats like to eat?"), dict(GREEDY, max_tokens=20)),
                  Arrival(7, "r6", user("What colour is the sky?"), dict(GREEDY, max_tokens=12))]),
    ),
    Scenario(
        "memory-pressure",
        "A pool too small for everyone: the newest request is preempted, then recomputed.",
        dict(block_size=4, num_blocks=20, max_num_batched_tokens=32, max_num_seqs=6),
        [Arrival(0, f"r{i}", TEXT[: 10 + 4 * i], dict(max_tokens=16)) for i in range(5)],
        Workload(dict(block_size=8, num_blocks=30, max_num_batched_tokens=128, max_num_seqs=6),
                 [Arrival(0, f"r{i}", user(q), dict(GREEDY, max_tokens=40)) for i, q in enumerate([
                     "Write a short poem about the sea.", "Tell me a story about a dragon.",
                     "Describe the moon to a child.", "Explain how rain forms.", "Why is the sky blue?"])]),
    ),
    Scenario(
        "long-prompt",
        "Chunked prefill: a long prompt spreads over several steps while short ones decode.",
        dict(block_size=8, num_blocks=64, max_num_batched_tokens=24, max_num_seqs=4),
        [Arrival(0, "short1", "Hi!", dict(max_tokens=16)),
         Arrival(0, "short2", "Hey", dict(max_tokens=16)),
         Arrival(1, "long", TEXT * 3, dict(max_tokens=6))],
        Workload(dict(block_size=8, num_blocks=96, max_num_batched_tokens=40, max_num_seqs=4),
                 [Arrival(0, "short1", user("Hi! How are you?"), dict(GREEDY, max_tokens=24)),
                  Arrival(0, "short2", user("What is a block?"), dict(GREEDY, max_tokens=24)),
                  Arrival(3, "long", user("Summarise in one sentence: " + ARTICLE), dict(GREEDY, max_tokens=24))]),
    ),
    Scenario(
        "shared-system-prompt",
        "One system prompt for all: its cached blocks are reused, later prefills skip it.",
        dict(block_size=8, num_blocks=96, max_num_batched_tokens=64, max_num_seqs=4),
        [Arrival(i, f"q{i}", SYSTEM + q, dict(max_tokens=8))
         for i, q in enumerate(["What is 2+2?", "Name a colour.", "Say hello.", "Count to 3.", "Pick a fruit."])],
        Workload(dict(block_size=8, num_blocks=96, max_num_batched_tokens=128, max_num_seqs=4),
                 [Arrival(i, f"q{i}", user(q, TEACHER), dict(GREEDY, max_tokens=32)) for i, q in enumerate([
                     "What is a token?", "Why do we cache keys and values?", "What is a batch?",
                     "What does a GPU do?", "What is a prompt?"])]),
    ),
    Scenario(
        "parallel-sampling",
        "n=3 samples and a beam search fork one prompt: shared blocks, copy-on-write, pruning.",
        dict(block_size=4, num_blocks=64, max_num_batched_tokens=64, max_num_seqs=8),
        [Arrival(0, "sample", "Once upon a time", dict(n=3, max_tokens=10, temperature=1.0, seed=1)),
         Arrival(1, "beam", "The best answer is", dict(beam_width=3, n=3, temperature=0, max_tokens=8,
                                                       min_tokens=8))],
        Workload(dict(block_size=4, num_blocks=128, max_num_batched_tokens=128, max_num_seqs=8),
                 [Arrival(0, "sample", user("Write a one-line slogan for a bakery."),
                          dict(n=3, max_tokens=16, temperature=0.8, seed=1)),
                  Arrival(1, "beam", user("Finish the sentence: the best way to learn is"),
                          dict(beam_width=3, n=3, temperature=0, max_tokens=12))]),
    ),
    Scenario(
        "swap-preemption",
        "A small pool with swap space: victims' KV moves to the CPU pool and back.",
        dict(block_size=4, num_blocks=20, max_num_batched_tokens=32, max_num_seqs=6, preemption_mode="swap",
             num_cpu_blocks=16, enable_prefix_caching=False),
        [Arrival(0, f"r{i}", TEXT[: 10 + 4 * i], dict(max_tokens=16)) for i in range(5)],
        Workload(dict(block_size=8, num_blocks=30, max_num_batched_tokens=128, max_num_seqs=6,
                      preemption_mode="swap", num_cpu_blocks=32, enable_prefix_caching=False),
                 [Arrival(0, f"r{i}", user(q), dict(GREEDY, max_tokens=40)) for i, q in enumerate([
                     "Write a short poem about the sea.", "Tell me a story about a dragon.",
                     "Describe the moon to a child.", "Explain how rain forms.", "Why is the sky blue?"])]),
    ),
    Scenario(
        "speculative-decoding",
        "N-gram drafts copied from the prompt: several tokens per step, rejected KV trimmed.",
        dict(block_size=4, num_blocks=64, max_num_batched_tokens=64, max_num_seqs=4,
             speculative_method="ngram", num_speculative_tokens=4, ngram_min=1, ngram_max=3),
        [Arrival(0, "repeat", list(range(40, 52)) * 3, dict(max_tokens=24, temperature=0)),
         Arrival(0, "other", [7, 8, 9, 7, 8, 9, 7], dict(max_tokens=16, temperature=0))],
        Workload(dict(block_size=8, num_blocks=96, max_num_batched_tokens=128, max_num_seqs=4,
                      speculative_method="ngram", num_speculative_tokens=4, ngram_min=1, ngram_max=3),
                 [Arrival(0, "repeat", user("Repeat this text exactly: " + PROVERBS), dict(GREEDY, max_tokens=40)),
                  Arrival(0, "rewrite", user("Rewrite this paragraph, keeping every sentence: " + PAGED),
                          dict(GREEDY, max_tokens=40))]),
    ),
    Scenario(
        "structured-output",
        "Grammars choose the tokens: each step a mask allows a few of the vocabulary; JSON, a choice and "
        "a date always parse, free text beside them does not have to.",
        dict(block_size=8, num_blocks=96, max_num_batched_tokens=64, max_num_seqs=4),
        [Arrival(0, "json", "Person: ", dict(max_tokens=96, temperature=1.0, seed=2,
                                            structured_outputs=dict(json=PERSON))),
         Arrival(0, "choice", "Answer: ", dict(max_tokens=8, temperature=1.0, seed=2,
                                              structured_outputs=dict(choice=["yes", "no", "maybe"]))),
         Arrival(1, "date", "Date: ", dict(max_tokens=16, temperature=1.0, seed=3,
                                          structured_outputs=dict(regex=DATE))),
         Arrival(2, "free", "Free text: ", dict(max_tokens=16))],
        Workload(dict(block_size=8, num_blocks=96, max_num_batched_tokens=128, max_num_seqs=4),
                 [Arrival(0, "json", user("Ada Lovelace was born in 1815 in London. Give her as JSON."),
                          dict(GREEDY, max_tokens=64, structured_outputs=dict(json=PERSON))),
                  Arrival(0, "choice", user("Is the sky green? Answer yes or no."),
                          dict(GREEDY, max_tokens=8, structured_outputs=dict(choice=["yes", "no"]))),
                  Arrival(1, "date", user("On which date did people first walk on the Moon?"),
                          dict(GREEDY, max_tokens=16, structured_outputs=dict(regex=DATE))),
                  Arrival(2, "free", user("Describe the Moon in one sentence."), dict(GREEDY, max_tokens=24))]),
    ),
    Scenario(
        "sliding-window",
        "Gemma 3's shape (tiny-gemma3): local layers with an 8-token window keep their own block tables, and "
        "blocks the window passed go back while the global table grows.",
        dict(block_size=4, num_blocks=64, max_num_batched_tokens=16, max_num_seqs=4),
        [Arrival(0, "long", TEXT * 2, dict(max_tokens=32)),
         Arrival(2, "short", "Hello there!", dict(max_tokens=24))],
        # (tiny-gemma3 has no chat template: the plain workload runs; this one is for a chat model with windows)
        Workload(dict(block_size=8, num_blocks=96, max_num_batched_tokens=64, max_num_seqs=4),
                 [Arrival(0, "long", user("Summarise in one sentence: " + ARTICLE), dict(GREEDY, max_tokens=48)),
                  Arrival(2, "short", user("Say hello in Spanish."), dict(GREEDY, max_tokens=24))]),
        model="tiny-gemma3",
    ),
    Scenario(
        "tensor-parallel",
        "The model split over processes (workers start first): each rank's pool has the same block "
        "tables and its own KV heads; k switches rank.",
        dict(block_size=4, num_blocks=48, max_num_batched_tokens=32, max_num_seqs=6, tensor_parallel_size=2),
        [Arrival(0, "q0", SYSTEM + "What is 2+2?", dict(max_tokens=8)),
         Arrival(1, "q1", SYSTEM + "Name a colour.", dict(max_tokens=8)),
         Arrival(2, "fork", "Once upon a time,", dict(n=2, max_tokens=10, temperature=1.0, seed=1))],
        # SmolLM2-135M has 9 query heads and 3 KV heads: 3 ranks (2 does not divide them).
        Workload(dict(block_size=8, num_blocks=96, max_num_batched_tokens=128, max_num_seqs=6,
                      tensor_parallel_size=3),
                 [Arrival(0, "q0", user("What is a token?", TEACHER), dict(GREEDY, max_tokens=24)),
                  Arrival(1, "q1", user("What is a batch?", TEACHER), dict(GREEDY, max_tokens=24)),
                  Arrival(2, "fork", user("Write a one-line slogan for a small bakery."),   # 41 tokens: a partial block
                          dict(n=2, max_tokens=16, temperature=0.8, seed=1))]),
    ),
]}


def scenario_model(scenario: Scenario, model: str, loaded=None) -> tuple[str, object]:
    """The model a scenario runs (its own, when it names one) and the loaded model to reuse (None: load it)."""
    if scenario.model is not None and scenario.model != model:
        return scenario.model, None
    return model, loaded


def get_scenario(name: str) -> Scenario:
    if name not in SCENARIOS:
        raise ValueError(f"unknown scenario {name!r}; choose one of: {', '.join(SCENARIOS)}")
    return SCENARIOS[name]


def has_chat_template(tokenizer) -> bool:
    return tokenizer is not None and bool(getattr(tokenizer, "chat_template", None))


def chat_prompt(tokenizer, text: str) -> str:
    """One user turn in the model's chat template, ready for the answer (as `nanoserve generate --chat`)."""
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                         add_generation_prompt=True)


def request_args(arrival: Arrival, chat: bool, tokenizer) -> tuple[str | list[int], dict]:
    """The prompt and SamplingParams fields an arrival is added with.

    Chat workloads: messages in the model's own chat format, as text; a real model's EOS ends
    the answer. Plain workloads: EOS is ignored (random weights may emit it at once)."""
    if chat:
        return tokenizer.apply_chat_template(arrival.prompt, tokenize=False, add_generation_prompt=True), arrival.params
    # (a structured output's grammar decides where it ends: EOS only where it can)
    return arrival.prompt, {"ignore_eos": "structured_outputs" not in arrival.params, **arrival.params}


class ScenarioRunner:
    """Steps an engine through a scenario: adds each request at its step, then steps."""

    def __init__(self, scenario: Scenario, model: str = "tiny-llama", loaded=None, components=None,
                 settings: dict | None = None) -> None:
        """`settings`: EngineConfig fields over the scenario's own (the command line's engine flags)."""
        from nanoserve.config import EngineConfig
        from nanoserve.engine import LLMEngine

        self.scenario = scenario
        settings = settings or {}
        model, loaded = scenario_model(scenario, model, loaded)
        loaded = loaded or load_for(model, settings)
        self.chat = has_chat_template(loaded.tokenizer) and scenario.chat is not None
        workload = scenario.workload(self.chat)
        config = EngineConfig(**{**workload.config, **settings, "model": model})
        self.engine = LLMEngine(config, loaded=loaded, components=components)
        self.pending = sorted(workload.arrivals, key=lambda a: a.step)
        self.add_due()                     # the first arrivals wait in the queue before step 1

    @property
    def done(self) -> bool:
        return not self.pending and not self.engine.has_unfinished_requests()

    def add_due(self) -> None:
        """Add the requests whose arrival step has come."""
        from nanoserve.sampling_params import SamplingParams

        while self.pending and self.pending[0].step <= self.engine.step_count:
            a = self.pending.pop(0)
            prompt, params = request_args(a, self.chat, self.engine.tokenizer)
            self.engine.add_request(a.request_id, prompt, SamplingParams(**params))

    def step(self):
        """Run one engine step, then add the requests due before the next; returns the StepResult."""
        result = self.engine.step()
        self.add_due()
        return result


def load_for(model: str, settings: dict):
    """The model loaded as engine settings ask (dtype, device, seed: none of them a scenario's own)."""
    import torch

    from nanoserve.models.loader import load_model

    dtype = getattr(torch, settings.get("dtype", "float32"))
    return load_model(model, dtype, settings.get("device", "cpu"), settings.get("seed", 0))


def record(name: str, path: str | Path, model: str = "tiny-llama", max_steps: int = 1000, loaded=None,
           components=None, settings: dict | None = None) -> int:
    """Run scenario `name` to the end, writing every event to `path`; returns the number of steps.
    `components` (a `Components`) runs the engine with replaced parts, e.g. a lab's; `settings` are
    EngineConfig fields over the scenario's."""
    from nanoserve.trace import JsonlRecorder

    runner = ScenarioRunner(get_scenario(name), model, loaded=loaded, components=components, settings=settings)
    with runner.engine, JsonlRecorder(path) as recorder:   # (the engine stops any worker processes at the end)
        runner.engine.subscribe(recorder)
        steps = 0
        while not runner.done and steps < max_steps:
            runner.step()
            steps += 1
    return steps
