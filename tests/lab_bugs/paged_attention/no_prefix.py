"""Bug: prefill_mask is a plain lower triangle: query i sees keys 0..i, as if the chunk started at position 0."""
import torch

from nanoserve.kernels import reference as _ref
from nanoserve.kernels.reference import decode_attention, decode_mask, gather_kv, store_kv  # noqa: F401

EXPECT_HINT = "causal over the cached prefix"


def prefill_mask(num_q, context_len, device):
    return torch.ones(num_q, context_len, dtype=torch.bool, device=device).tril()


def prefill_attention(q, k_cache, v_cache, block_table, context_len, scale, mask=None, compute_dtype=None):
    return _ref.prefill_attention(q, k_cache, v_cache, block_table, context_len, scale,
                                  prefill_mask(q.shape[0], context_len, q.device), compute_dtype)
