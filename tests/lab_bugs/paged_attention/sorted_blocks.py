"""Bug: gather_kv reads a table's blocks in increasing id order, not in the table's order."""
import torch  # noqa: F401

from nanoserve.kernels import reference as _ref
from nanoserve.kernels.reference import decode_mask, prefill_mask, store_kv  # noqa: F401

EXPECT_HINT = "keep the table's order"


def gather_kv(cache, block_tables):
    return _ref.gather_kv(cache, block_tables.sort(dim=-1).values)


def decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, mask=None, compute_dtype=None):
    return _ref.decode_attention(q, k_cache, v_cache, block_tables.sort(dim=-1).values, seq_lens, scale, mask,
                                 compute_dtype)


def prefill_attention(q, k_cache, v_cache, block_table, context_len, scale, mask=None, compute_dtype=None):
    return _ref.prefill_attention(q, k_cache, v_cache, block_table.sort().values, context_len, scale, mask,
                                  compute_dtype)
