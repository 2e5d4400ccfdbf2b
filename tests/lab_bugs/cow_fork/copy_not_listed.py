"""Bug: copy_on_write switches to a fresh block but never asks the runner to copy the KV into it."""
from nanoserve import events as ev
from nanoserve.kv_manager import KVManager as _KV

EXPECT_HINT = "append (src, dst) to self.moves.copies"


class KVManager(_KV):
    def copy_on_write(self, seq):
        i = self._shared_write_block(seq)
        if i is None:
            return None
        src = seq.block_table[i]
        dst = self._take(1)[0]
        self.pool.free([src])
        seq.block_table[i] = dst
        self.emit(ev.CowCopied(self.step, seq.seq_id, i, src, dst))
        return src, dst
