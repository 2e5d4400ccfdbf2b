"""Bug: copy_on_write takes a copy but never lets go of the shared block (a leaked holder)."""
from nanoserve import events as ev
from nanoserve.kv_manager import KVManager as _KV

EXPECT_HINT = "free it once"


class KVManager(_KV):
    def copy_on_write(self, seq):
        i = self._shared_write_block(seq)
        if i is None:
            return None
        src = seq.block_table[i]
        dst = self._take(1)[0]
        seq.block_table[i] = dst
        self.moves.copies.append((src, dst))
        self.emit(ev.CowCopied(self.step, seq.seq_id, i, src, dst))
        return src, dst
