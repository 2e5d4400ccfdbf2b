"""Known bugs of the paged-attention lab (nanoserve/kernels/reference.py), and its equivalent mutants.
See make.py."""

from make import Bug

BUGS = (
    Bug("ignores_slots", "store_kv", "store_kv writes the step's tokens to slots 0, 1, 2, ... instead of their "
        "slot_mapping", (("index_copy_(0, slot_mapping, k)", "index_copy_(0, torch.arange(k.shape[0]), k)"),
                         ("index_copy_(0, slot_mapping, v)", "index_copy_(0, torch.arange(v.shape[0]), v)")),
        "slot_mapping[t]"),
    Bug("stores_k_only", "store_kv", "store_kv writes the keys but not the values",
        (("    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)\n", ""),), "v of token"),
    Bug("sorted_blocks", "gather_kv", "gather_kv reads a table's blocks in increasing id order, not in the table's "
        "order", (("block_tables.reshape(-1)", "block_tables.sort(dim=-1).values.reshape(-1)"),),
        "keep the table's order"),
    Bug("sees_padding", "decode_mask", "decode_mask uses <= where < belongs, so a decode also attends to the slot "
        "after its last token", (("[None, :] < seq_lens[:, None]", "[None, :] <= seq_lens[:, None]"),),
        "only the first seq_lens[b] positions"),
    Bug("mask_without_heads", "decode_mask", "decode_mask returns [B, L], without the head and query axes",
        (("    return valid[:, None, None, :]", "    return valid"),), "[B, 1, 1, L]"),
    Bug("no_prefix", "prefill_mask", "prefill_mask is a plain lower triangle: query i sees keys 0..i, as if the "
        "chunk started at position 0",
        (("q_pos = torch.arange(context_len - num_q, context_len, device=device)",
          "q_pos = torch.arange(num_q, device=device)"),), "causal over the cached prefix"),
)

EQUIVALENT = {
}
