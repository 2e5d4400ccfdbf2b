"""Bug: evict only considers the leaves it found at the start; a parent left childless is never evicted."""
import heapq

from nanoserve import events as ev
from nanoserve.radix_cache import RadixCache as _Cache
from nanoserve.radix_cache import RadixNode  # noqa: F401

EXPECT_HINT = "its parent may have become an unlocked leaf"


class RadixCache(_Cache):
    def evict(self, num_blocks):
        heap = [(n.last_access, n.node_id, n) for n in self.nodes.values() if not n.children and n.lock_count == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < num_blocks and heap:
            _, _, leaf = heapq.heappop(heap)
            del leaf.parent.children[self._key(leaf.tokens, 0)]
            del self.nodes[leaf.node_id]
            released = self.pool.free(leaf.block_ids)
            self.num_evictable_blocks -= len(leaf.block_ids)
            freed += len(released)
            self.emit(ev.RadixEvicted(self.step, leaf.node_id, tuple(released), leaf.last_access))
        return freed
