"""Bug: _shared_write_block ignores whether the block is partly filled, so a fork at a boundary copies a full block."""
from nanoserve.kv_manager import KVManager as _KV

EXPECT_HINT = "a full block is never written again"


class KVManager(_KV):
    def _shared_write_block(self, seq):
        i = min(seq.num_computed_tokens // self.pool.block_size, len(seq.block_table) - 1)
        if i >= 0 and self.pool.blocks[seq.block_table[i]].ref_count > 1:
            return i
        return None
