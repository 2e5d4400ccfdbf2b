"""Bug: store_kv writes the step's tokens to slots 0, 1, 2, ... instead of their slot_mapping."""
import torch

from nanoserve.kernels.reference import decode_attention, decode_mask, gather_kv, prefill_attention, prefill_mask  # noqa: F401  # noqa: F401

EXPECT_HINT = "write token t at slot_mapping[t]"


def store_kv(k, v, k_cache, v_cache, slot_mapping):
    rows = torch.arange(k.shape[0])
    k_cache.view(-1, k_cache.shape[2], k_cache.shape[3]).index_copy_(0, rows, k)
    v_cache.view(-1, v_cache.shape[2], v_cache.shape[3]).index_copy_(0, rows, v)
