"""Known bugs of the block-pool lab (nanoserve/block_pool.py), and its equivalent mutants. See make.py."""

from make import Bug

BUGS = (
    Bug("append_at_head", "FreeBlockQueue.append", "append links the block in after the head sentinel, not before "
        "the tail: the queue reuses the most recently freed block first (and every caller looks wrong)",
        (("last = self.tail.prev\n        last.next, block.prev = block, last\n"
          "        block.next, self.tail.prev = self.tail, block",
          "first = self.head.next\n        self.head.next, block.prev = block, self.head\n"
          "        block.next, first.prev = first, block"),), "freed longest ago"),
    Bug("one_sided_remove", "FreeBlockQueue.remove", "remove fixes the forward link only; walking the queue "
        "backwards goes wrong",
        (("block.prev.next, block.next.prev = block.next, block.prev", "block.prev.next = block.next"),),
        "links disagree"),
    Bug("remove_keeps_links", "FreeBlockQueue.remove", "remove leaves the removed block's prev/next pointing into "
        "the queue", (("        block.prev = block.next = None\n", ""),), "still points into the queue"),
    Bug("popleft_no_empty_check", "FreeBlockQueue.popleft", "popleft on an empty queue pops the tail sentinel "
        "(AttributeError, and a corrupted list) instead of raising IndexError",
        (('        if self.size == 0:\n            raise IndexError("no free blocks")\n', ""),), "IndexError"),
    Bug("mru_allocate", "BlockPool.allocate", "allocate takes blocks from the tail of the free queue (most recently "
        "freed first), not the head",
        (("block = self.free_queue.popleft()",
          "block = self.free_queue.tail.prev\n            self.free_queue.remove(block)"),), "HEAD"),
    Bug("partial_allocate", "BlockPool.allocate", "allocate takes blocks one by one and fails half way when the "
        "queue runs dry (not all or nothing, and IndexError instead of MemoryError)",
        (('        if n > len(self.free_queue):\n            raise MemoryError(f"asked for {n} blocks, '
          '{len(self.free_queue)} free")\n', ""),), "MemoryError"),
    Bug("allocate_negative", "BlockPool.allocate", "allocate(-1) quietly returns [] instead of raising ValueError",
        (('        if n < 0:\n            raise ValueError(f"cannot allocate {n} blocks")\n', ""),), "ValueError"),
    Bug("forward_free", "BlockPool.free", "free walks the table first block first, so a request's prefix is reused "
        "before its tail", (("for block_id in reversed(block_ids):", "for block_id in block_ids:"),), "in which order"),
    Bug("free_while_shared", "BlockPool.free", "free puts a block back in the free queue at its first holder's "
        "free, while another table holds it",
        (("if block.ref_count == 0:\n                self.free_queue.append(block)",
          "if block.block_id not in self.free_queue.ids():\n                self.free_queue.append(block)"),),
        "free"),
    Bug("free_no_range_check", "BlockPool.free", "free checks no id range: free([-1]) frees the last block through "
        "negative indexing", (("            self._check_id(block_id)\n            if self.blocks[block_id].ref_count "
                               "< times", "            if self.blocks[block_id].ref_count < times"),),
        "inside the pool"),
    Bug("share_no_range_check", "BlockPool.share", "share checks no id range: share([-1]) adds a holder to the last "
        "block, share([num_blocks]) raises IndexError",
        (("            self._check_id(block_id)\n", ""),), "ValueError"),
    Bug("share_partial", "BlockPool.share", "share adds holders as it checks: a bad id after a good one leaves "
        "the good one shared (not all or nothing)",
        (('                raise ValueError(f"cannot share free block {block_id}")\n        for block_id in '
          'block_ids:\n            self.blocks[block_id].ref_count += 1',
          '                raise ValueError(f"cannot share free block {block_id}")\n'
          '            self.blocks[block_id].ref_count += 1'),), "changed the pool"),
)

# Mutants (benchmarks/lab_mutation.py) that no check can kill: the behaviour is provably the same.
EQUIVALENT = {
}
