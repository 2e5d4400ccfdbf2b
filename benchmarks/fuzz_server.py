"""`nanoserve serve` fuzzed from its own OpenAPI schema with schemathesis, run long, on loopback.

    OMP_NUM_THREADS=1 python benchmarks/fuzz_server.py --examples 300 --rounds 3

A server (tiny-llama with a chat template, a small context so any request ends in a few
steps) runs on a free 127.0.0.1 port in this process. Each round, schemathesis generates
`--examples` valid and `--examples` invalid requests for every operation of /openapi.json
(GET /events aside: an endless stream), half of them naming the served model; every response
must not be a 5xx and every error must be OpenAI-shaped (tests/serve_fuzz.py). After each
round the server must be whole: engine thread alive, /health 200, no request left in the
engine or the clients table, invariants, no leaked block. It prints the operations tried, the
cases sent and the status codes seen, and exits 1 on the first failure.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import traceback
from collections import Counter
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

CONFIG = dict(block_size=4, num_blocks=128, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=300, help="generated cases per operation and mode")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, each with its own seed")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    from serve_fuzz import check_server, fuzz
    from serve_helpers import running_server, save_chat_model

    from nanoserve.models.loader import load_model

    loaded = load_model(save_chat_model(Path(tempfile.mkdtemp()) / "chat-llama"))
    total: Counter = Counter()
    t0 = time.perf_counter()
    with running_server(loaded, CONFIG, max_waiting=8) as (url, server):
        print(f"server on {url} (loopback), model {loaded.name}, {CONFIG}", flush=True)
        for r in range(args.rounds):
            try:
                stats = fuzz(url, loaded.name, args.examples, seed=args.seed + r, log=print)
                check_server(url, server)
            except BaseException as exc:   # noqa: BLE001 -- print what failed, exit 1
                traceback.print_exception(exc)
                print(f"\nFAILED in round {r} (seed {args.seed + r}): {type(exc).__name__}: {exc}")
                return 1
            total.update(stats)
            print(f"round {r}: {stats['cases']} cases, server whole ({time.perf_counter() - t0:.0f} s)", flush=True)
        failures = server.engine_loop.failures
    statuses = {k: v for k, v in sorted(total.items()) if k.startswith("status")}
    print(f"\n{total['operations'] // args.rounds} operations x 2 modes x {args.rounds} rounds: {total['cases']} "
          f"cases in {time.perf_counter() - t0:.0f} s; 0 server errors, every error OpenAI-shaped; "
          f"after each round the engine thread alive, /health 200, nothing left, no block leaked")
    print("status codes: " + ", ".join(f"{k.split()[1]}: {v}" for k, v in statuses.items()))
    print(f"failures the engine loop survived and logged: {failures}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
