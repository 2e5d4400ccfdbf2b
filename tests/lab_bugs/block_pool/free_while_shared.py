"""Bug: free puts a block back in the free queue at its first holder's free, while another table holds it."""
from nanoserve.block_pool import Block, FreeBlockQueue  # noqa: F401
from nanoserve.block_pool import BlockPool as _Pool

EXPECT_HINT = "freed while a table still points at it"


class BlockPool(_Pool):
    def free(self, block_ids):
        released = []
        for block_id in reversed(block_ids):
            block = self.blocks[block_id]
            if block.ref_count == 0:
                raise ValueError(f"double free of block {block_id}")
            block.ref_count -= 1
            if block.block_id not in self.free_queue.ids():
                self.free_queue.append(block)
                released.append(block_id)
        return released
