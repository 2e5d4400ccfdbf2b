"""Bug: a new node is filed under the key of its whole span, not of its first block: it is never matched."""
from nanoserve import events as ev
from nanoserve.radix_cache import RadixCache as _Cache
from nanoserve.radix_cache import RadixNode

EXPECT_HINT = "loses its key"


class RadixCache(_Cache):
    def _add_node(self, seq_id, parent, tokens, block_ids, first, end):
        bs = self.block_size
        span = tuple(tokens[first * bs : end * bs])
        node = RadixNode(self._next_id, parent, span, list(block_ids[first:end]), self.step)
        self._next_id += 1
        self.pool.share(node.block_ids)
        parent.children[span] = node                      # the bug: the key should be span[:block_size]
        self.nodes[node.node_id] = node
        self.num_evictable_blocks += len(node.block_ids)
        self.emit(ev.RadixInserted(self.step, seq_id, node.node_id, parent.node_id, "", len(span),
                                   tuple(node.block_ids)))
        return node
