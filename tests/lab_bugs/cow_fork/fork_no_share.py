"""Bug: fork copies the parent's table but adds no holder to its blocks."""
from nanoserve import events as ev
from nanoserve.kv_manager import KVManager as _KV

EXPECT_HINT = "fork must share"


class KVManager(_KV):
    def fork(self, parent, child, seed=-1):
        child.block_table = list(parent.block_table)
        child.num_computed_tokens = parent.num_computed_tokens
        self.emit(ev.Forked(self.step, parent.seq_id, child.seq_id, tuple(child.block_table), seed))
        if parent.cache_node is not None:
            self._relock(child, parent.cache_node)
