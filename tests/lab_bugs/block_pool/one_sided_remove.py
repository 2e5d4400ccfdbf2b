"""Bug: FreeBlockQueue.remove fixes the forward link only; walking the queue backwards goes wrong."""
from nanoserve.block_pool import Block  # noqa: F401
from nanoserve.block_pool import BlockPool as _Pool
from nanoserve.block_pool import FreeBlockQueue as _Queue

EXPECT_HINT = "update BOTH links"


class FreeBlockQueue(_Queue):
    def remove(self, block):
        block.prev.next = block.next
        block.prev = block.next = None
        self.size -= 1


class BlockPool(_Pool):
    def __init__(self, num_blocks, block_size):
        super().__init__(num_blocks, block_size)
        self.free_queue = FreeBlockQueue(self.blocks)
