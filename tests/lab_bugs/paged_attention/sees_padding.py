"""Bug: decode_mask uses <= where < belongs, so a decode also attends to the slot after its last token."""
import torch

from nanoserve.kernels import reference as _ref
from nanoserve.kernels.reference import gather_kv, prefill_attention, prefill_mask, store_kv  # noqa: F401

EXPECT_HINT = "only the first seq_lens[b] positions"


def decode_mask(seq_lens, L):
    valid = torch.arange(L, device=seq_lens.device)[None, :] <= seq_lens[:, None]
    return valid[:, None, None, :]


def decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, mask=None, compute_dtype=None):
    L = block_tables.shape[1] * k_cache.shape[1]
    return _ref.decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale,
                                 decode_mask(seq_lens, L), compute_dtype)
