"""Bug: free walks the table first block first, so a request's prefix is reused before its tail."""
from nanoserve.block_pool import Block, FreeBlockQueue  # noqa: F401
from nanoserve.block_pool import BlockPool as _Pool

EXPECT_HINT = "LAST block to its first"


class BlockPool(_Pool):
    def free(self, block_ids):
        return super().free(list(reversed(block_ids)))
