"""Speculative decoding under a grammar samples exactly from the masked distribution.

The harness of test_spec_distribution.py with a grammar: a tiny random model
with an 8-token vocabulary (EOS and the letters a..g, with a byte-level
tokenizer so xgrammar can read it), the regex (a[bc]|b[a-g]|c)[a-g]*, and the
exact joint distribution of the first two tokens computed from the target's
own logits, masked by allowed sets written out by hand (not by xgrammar):

    first token     a, b or c
    after a         b or c
    after b         any letter
    after c         any letter, or EOS (the grammar can end there)

Thousands of seeded requests, speculating with a 1-layer draft model (whose
guesses ignore the grammar, so many are rejected for sure) and with n-gram
lookup, must match those probabilities.
"""

from __future__ import annotations

import pytest
import torch
from conftest import make_engine
from test_spec_distribution import PROMPT, TV_BOUND, VOCAB, tv

from nanoserve import SamplingParams
from nanoserve.runner import RunInput
from nanoserve.sampler import SamplingRow, probs
from nanoserve.structured_output import mask_words

NUM_REQUESTS = 12000
LETTERS = "abcdefg"                     # token ids 1..7; 0 is EOS
A, B, C = 1, 2, 3
REGEX = r"(a[bc]|b[a-g]|c)[a-g]*"
ALLOWED_FIRST = {A, B, C}
ALLOWED_AFTER = {A: {B, C}, B: set(range(1, 8)), C: set(range(0, 8))}


def bitmask(allowed: set[int]) -> torch.Tensor:
    row = torch.zeros(mask_words(VOCAB), dtype=torch.int64)
    for t in allowed:
        row[t // 32] |= 1 << (t % 32)
    return row.to(torch.int32)


@pytest.fixture(scope="module")
def letters_model(tmp_path_factory):
    from conftest import save_tiny
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from nanoserve.models.loader import load_model
    path = save_tiny("tiny-llama", tmp_path_factory.mktemp("v8g"), with_tokenizer=False, vocab_size=VOCAB,
                     initializer_range=0.3, bos_token_id=0, eos_token_id=0)
    tok = Tokenizer(models.BPE(vocab={"<|endoftext|>": 0, **{c: i + 1 for i, c in enumerate(LETTERS)}}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok)
    fast.add_special_tokens({"eos_token": "<|endoftext|>"})
    fast.save_pretrained(path)
    return load_model(path)


def exact_joint(loaded, params: SamplingParams) -> torch.Tensor:
    engine = make_engine(loaded, num_blocks=64)

    def next_probs(output, allowed):
        tokens = PROMPT + output
        table = engine.pool.allocate(engine.pool.blocks_needed(0, len(tokens)))
        logits = engine.runner.run(engine.runner.prepare([RunInput(tokens, 0, table)]))
        engine.pool.free(table)
        return probs(logits, [SamplingRow(params, PROMPT, output, None, 0, bitmask(allowed))])[0]

    p1 = next_probs([], ALLOWED_FIRST)
    joint = torch.zeros(VOCAB, VOCAB)
    for t1 in ALLOWED_FIRST:
        joint[t1] = p1[t1] * next_probs([t1], ALLOWED_AFTER[t1])
    return joint


PROPOSERS = {
    "draft": dict(speculative_method="draft", num_speculative_tokens=2, draft_num_layers=1),
    "ngram": dict(speculative_method="ngram", num_speculative_tokens=2, ngram_min=1, ngram_max=2),
}


@pytest.mark.slow          # 12,000 requests per run: minutes
@pytest.mark.parametrize("proposer", list(PROPOSERS))
def test_speculation_under_a_grammar_matches_the_exact_masked_joint(letters_model, proposer):
    params = SamplingParams(max_tokens=3, temperature=1.0, structured_outputs=dict(regex=REGEX))
    exact = exact_joint(letters_model, params)
    assert exact.sum() == pytest.approx(1.0, abs=1e-5) and exact[0].sum() == 0 and exact[A, A] == 0   # masked
    engine = make_engine(letters_model, block_size=4, num_blocks=4096, max_num_seqs=512,
                         max_num_batched_tokens=4096, **PROPOSERS[proposer])
    for i in range(NUM_REQUESTS):
        engine.add_request(str(i), PROMPT, SamplingParams(max_tokens=3, temperature=1.0, seed=10_000 + i,
                                                          structured_outputs=dict(regex=REGEX)))
    counts = torch.zeros(VOCAB, VOCAB)
    drafted = accepted = 0
    while engine.has_unfinished_requests():
        result = engine.step()
        drafted += result.stats.num_drafted
        accepted += result.stats.num_accepted
        for out in result.outputs:
            if out.finished:
                t = out.outputs[0].token_ids
                counts[t[0], t[1]] += 1
    assert 0 < accepted < drafted, "both acceptances and rejections must occur for the test to mean anything"
    assert tv(counts / NUM_REQUESTS, exact) < TV_BOUND
