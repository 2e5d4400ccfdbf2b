"""Bug: copy-on-write never fires: a shared, partly filled last block is written by both sequences."""
from nanoserve.kv_manager import KVManager as _KV

EXPECT_HINT = "forgets the partial last block"


class KVManager(_KV):
    def _shared_write_block(self, seq):
        return None
