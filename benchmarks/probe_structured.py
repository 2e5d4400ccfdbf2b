"""Structured output over HTTP, probed: every hostile constraint is a 4xx (never a 5xx), and a short
request beside a large grammar is not held up by its compile.

    OMP_NUM_THREADS=1 python benchmarks/probe_structured.py                    # tiny-llama: a minute
    OMP_NUM_THREADS=1 python benchmarks/probe_structured.py --model smollm2 --latency-only

1. Probes: each constraint in CONSTRAINTS (empty masks, grammars past the limits, recursive and
   huge schemas, regexes that match nothing, choices shorter than min_tokens, ...) is sent with
   each of MODES (n=2, logprobs, stop, stream, min_tokens, max_tokens=1) to a server, and to a
   second one with speculative decoding (n-gram). Every answer must be 2xx or an OpenAI-shaped
   4xx; after all of them the server must be whole (engine thread alive, nothing left, no block
   leaked). It prints the status codes seen.
2. Latency: a 2-token completion alone, then sent while a structured-output request with a large
   grammar (new each round: no cache hit) is being compiled; the median of `--rounds` each. The
   target (issue 46): beside it, within 2x its time alone. A 1 MB grammar (refused by its size) and
   the slowest grammar the limits accept on this vocabulary are both tried.

Times on a shared machine are noisy: read the ratio, and run it again.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import httpx  # noqa: E402

CONFIG = dict(block_size=4, num_blocks=256, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128)


def rules(n: int, body: str = '"x"') -> str:
    return "root ::= " + " ".join(f"r{i}" for i in range(n)) + "\n" + "".join(f"r{i} ::= {body} \"{i}\"\n"
                                                                          for i in range(n))


RECURSIVE = {"$defs": {"n": {"type": "object", "properties": {"v": {"type": "integer"},
                                                              "kids": {"type": "array", "items": {"$ref": "#/$defs/n"}}},
                             "required": ["v"]}}, "$ref": "#/$defs/n"}
CONSTRAINTS = {
    "empty regex": {"guided_regex": "[^\\x00-\\U0010ffff]"},
    "root ::= root": {"guided_grammar": "root ::= root"},
    "left recursion": {"guided_grammar": 'root ::= root "a" | "b"'},
    "mutual recursion only": {"guided_grammar": "root ::= a\na ::= root"},
    "empty string grammar": {"guided_grammar": 'root ::= ""'},
    "choice shorter than min_tokens": {"guided_choice": ["y", "n"], "min_tokens": 8},
    "one-byte choice": {"guided_choice": ["y"]},
    "grammar ending before min_tokens": {"guided_grammar": 'root ::= "ab"', "min_tokens": 5},
    "1 MB grammar": {"guided_grammar": "root ::= " + " | ".join(f'"w{i}x"' for i in range(100_000))},
    "600 rules": {"guided_grammar": rules(600)},
    "5000 chained rules": {"guided_grammar": "root ::= r0\n" + "".join(f'r{i} ::= "a" r{i + 1} | "b"\n'
                                                                       for i in range(5000)) + 'r5000 ::= "z"\n'},
    "huge repeat": {"guided_grammar": "root ::= [a-z]{0,1000000}"},
    "nested repeats": {"guided_regex": "((a|b){0,2000}c){0,2000}"},
    "recursive schema": {"guided_json": RECURSIVE},
    "deep schema": {"guided_json": json.loads('{"type":"object","properties":{"a":' * 60 + '{"type":"integer"}'
                                              + "}}" * 60)},
    "schema maxLength 10**9": {"guided_json": {"type": "string", "maxLength": 10**9}},
    "schema minItems > maxItems": {"guided_json": {"type": "array", "minItems": 5, "maxItems": 2}},
    "schema enum of nothing": {"guided_json": {"enum": []}},
    "schema false": {"guided_json": "false"},
    "json_object": {"response_format": {"type": "json_object"}},
    "strict schema": {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "strict": True,
                                                                                 "schema": RECURSIVE}}},
    "bad regex": {"guided_regex": "(((("},
    "lone surrogate in a choice": {"guided_choice": ["\ud800"]},
    "two ways at once": {"guided_regex": "a", "guided_choice": ["a"]},
    "structured_outputs unknown key": {"structured_outputs": {"regex": "a", "bogus": 1}},
}
MODES = {
    "plain": {},
    "n=2": {"n": 2, "temperature": 1.0, "seed": 1},
    "logprobs": {"logprobs": 3},
    "stop": {"stop": ["a", "}"]},
    "stream": {"stream": True},
    "min_tokens": {"min_tokens": 3},
    "max_tokens=1": {"max_tokens": 1},
    "eos ignored": {"ignore_eos": True, "max_tokens": 6},
}


def shaped(resp: httpx.Response) -> bool:
    try:
        error = resp.json()["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return set(error) == {"message", "type", "param", "code"} and bool(error["message"])


def probe(url: str, model: str, counts: Counter, failures: list) -> None:
    for name, constraint in CONSTRAINTS.items():
        for mode, fields in MODES.items():
            body = {"model": model, "prompt": "Hello", "max_tokens": 8, "temperature": 0, **fields, **constraint}
            if "min_tokens" in constraint and "max_tokens" in fields:
                body["max_tokens"] = max(body["max_tokens"], constraint["min_tokens"])
            try:
                resp = httpx.post(url + "/v1/completions", content=json.dumps(body).encode("utf-8", "surrogatepass"),
                                  headers={"content-type": "application/json"}, timeout=120)
            except httpx.HTTPError as exc:
                failures.append(f"{name} / {mode}: {type(exc).__name__}: {exc}")
                continue
            counts[resp.status_code] += 1
            if resp.status_code >= 500 or (resp.status_code >= 400 and not shaped(resp)):
                failures.append(f"{name} / {mode}: {resp.status_code} {resp.text[:200]}")
            elif fields.get("stream") and '"error"' in resp.text and '"type":"server_error"' in resp.text:
                failures.append(f"{name} / {mode}: a server_error in the stream: {resp.text[-300:]}")


def short_request(url: str, model: str) -> float:
    t = time.perf_counter()
    resp = httpx.post(url + "/v1/completions", json={"model": model, "prompt": "Hi", "max_tokens": 2,
                                                     "temperature": 0}, timeout=120)
    assert resp.status_code == 200, resp.text
    return time.perf_counter() - t


def latency(url: str, model: str, grammar_of, rounds: int) -> tuple[float, float, Counter]:
    """(median alone, median beside a large grammar's request, the large requests' status codes)."""
    alone = [short_request(url, model) for _ in range(rounds)]
    beside, codes = [], Counter()
    for r in range(rounds):
        started = threading.Event()
        body = json.dumps({"model": model, "prompt": "Hi", "max_tokens": 4, "guided_grammar": grammar_of(r)})

        def large(body=body):           # (the body is made before: this process is the client too)
            started.set()
            resp = httpx.post(url + "/v1/completions", content=body, timeout=300,
                              headers={"content-type": "application/json"})
            codes[resp.status_code] += 1

        thread = threading.Thread(target=large)
        thread.start()
        started.wait()
        time.sleep(0.05)                       # the large request is read and compiling
        beside.append(short_request(url, model))
        thread.join()
    return statistics.median(alone), statistics.median(beside), codes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a model name (default: tiny-llama with a chat template)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--latency-only", action="store_true", help="skip the probes (part 1)")
    args = parser.parse_args()

    from serve_helpers import check_clean, running_server, save_chat_model, wait_idle

    from nanoserve.models.loader import load_model

    loaded = load_model(args.model) if args.model else load_model(save_chat_model(Path(tempfile.mkdtemp()) / "chat"))
    counts: Counter = Counter()
    failures: list[str] = []
    for config in () if args.latency_only else (CONFIG, {**CONFIG, "speculative_method": "ngram",
                                                            "num_speculative_tokens": 3}):
        with running_server(loaded, config) as (url, server):
            t0 = time.perf_counter()
            probe(url, loaded.name, counts, failures)
            wait_idle(server)
            check_clean(server)
            print(f"{config.get('speculative_method') or 'no speculation'}: {len(CONSTRAINTS)} constraints x "
                  f"{len(MODES)} modes in {time.perf_counter() - t0:.0f} s; server whole", flush=True)
    if counts:
        print("status codes: " + ", ".join(f"{k}: {v}" for k, v in sorted(counts.items())))
    for f in failures:
        print("FAILED", f)

    with running_server(loaded, CONFIG) as (url, server):
        short_request(url, loaded.name)        # warm up
        big = lambda r: "root ::= " + " | ".join(f'"w{r}x{i}"' for i in range(100_000))   # noqa: E731
        slow = lambda r: f'root ::= [^"]{{0,{100 + r}}} "x"'   # noqa: E731 -- ~4 s on SmolLM2's vocabulary
        for name, grammar_of in (("1 MB grammar (refused by size)", big), ("slowest accepted grammar", slow)):
            alone, beside, codes = latency(url, loaded.name, grammar_of, args.rounds)
            print(f"2-token request: alone {alone * 1000:.0f} ms, beside a {name} {beside * 1000:.0f} ms "
                  f"({beside / alone:.2f}x; the large requests answered {dict(codes)})", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
