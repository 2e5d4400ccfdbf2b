"""Bug: evict picks leaves without looking at their lock count, so a running request's blocks go."""
import heapq

from nanoserve import events as ev
from nanoserve.radix_cache import RadixCache as _Cache
from nanoserve.radix_cache import RadixNode  # noqa: F401

EXPECT_HINT = "evict only unlocked leaves"


class RadixCache(_Cache):
    def evict(self, num_blocks):
        heap = [(n.last_access, n.node_id, n) for n in self.nodes.values() if not n.children and n is not self.root]
        heapq.heapify(heap)
        freed = 0
        while freed < num_blocks and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            del parent.children[self._key(leaf.tokens, 0)]
            del self.nodes[leaf.node_id]
            released = self.pool.free(leaf.block_ids)
            self.num_evictable_blocks -= len(leaf.block_ids)
            freed += len(released)
            self.emit(ev.RadixEvicted(self.step, leaf.node_id, tuple(released), leaf.last_access))
            if parent is not self.root and not parent.children:
                heapq.heappush(heap, (parent.last_access, parent.node_id, parent))
        return freed
