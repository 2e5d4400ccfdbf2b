"""Bug: allocate takes blocks one by one and raises half way when the queue runs dry (not all or nothing)."""
from nanoserve.block_pool import Block, FreeBlockQueue  # noqa: F401
from nanoserve.block_pool import BlockPool as _Pool

EXPECT_HINT = "all or nothing"


class BlockPool(_Pool):
    def allocate(self, n):
        ids = []
        for _ in range(n):
            if not len(self.free_queue):
                raise MemoryError("out of blocks")
            block = self.free_queue.popleft()
            block.ref_count = 1
            ids.append(block.block_id)
        return ids
