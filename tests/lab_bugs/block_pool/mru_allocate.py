"""Bug: allocate takes blocks from the tail of the free queue (most recently freed first), not the head."""
from nanoserve.block_pool import Block, FreeBlockQueue  # noqa: F401
from nanoserve.block_pool import BlockPool as _Pool

EXPECT_HINT = "pop from the HEAD"


class BlockPool(_Pool):
    def allocate(self, n):
        if n > len(self.free_queue):
            raise MemoryError(f"asked for {n} blocks, {len(self.free_queue)} free")
        ids = []
        for _ in range(n):
            block = self.free_queue.tail.prev
            self.free_queue.remove(block)
            block.ref_count = 1
            ids.append(block.block_id)
        return ids
