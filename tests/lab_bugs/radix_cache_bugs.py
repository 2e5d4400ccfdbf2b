"""Known bugs of the radix-cache lab (nanoserve/radix_cache.py), and its equivalent mutants. See make.py."""

from make import Bug

HEAP = "heap = [(n.last_access, n.node_id, n) for n in self.nodes.values() if not n.children and n.lock_count == 0]"
PUSH = ("            if parent is not self.root and not parent.children and parent.lock_count == 0:\n"
        "                heapq.heappush(heap, (parent.last_access, parent.node_id, parent))\n")

BUGS = (
    Bug("full_prompt_match", "RadixCache.match_prefix", "match_prefix may match every block of the prompt, leaving "
        "no token to compute", (("max_blocks = (len(tokens) - 1) // self.block_size",
                                 "max_blocks = len(tokens) // self.block_size"),), "leaves nothing to compute"),
    Bug("match_no_split", "RadixCache.match_prefix", "a match that ends inside a node's span takes the blocks but "
        "does not split the node, and returns its parent",
        (("            if n < len(child.block_ids):\n                child = self._split(child, n)\n",
          "            if n < len(child.block_ids):\n                blocks += child.block_ids[:n]\n"
          "                break\n"),), "split"),
    Bug("no_duplicates", "RadixCache.insert", "insert walks past blocks the tree already holds without reporting the "
        "caller's duplicate copies", (("        return node, duplicates", "        return node, []"),),
        "duplicate prefix block is freed"),
    Bug("lost_key", "RadixCache.insert", "insert files each new node under its whole span, not under its first "
        "block: it is never matched again",
        (("                child = self._add_node(seq_id, node, tokens, block_ids, i, n)\n",
          "                child = self._add_node(seq_id, node, tokens, block_ids, i, n)\n"
          "                node.children[tuple(child.tokens)] = node.children.pop(key)\n"),), "key of its first block"),
    Bug("node_per_block", "RadixCache.insert", "insert adds one node per new block instead of one node for all of "
        "them", (("                child = self._add_node(seq_id, node, tokens, block_ids, i, n)\n"
                  "                i = n\n",
                  "                child = self._add_node(seq_id, node, tokens, block_ids, i, i + 1)\n"
                  "                i += 1\n"),), "how many nodes"),
    Bug("insert_no_touch", "RadixCache.insert", "insert does not touch the path it inserted, so a fresh prefix can "
        "be the first evicted", (("        self.touch(node)\n", ""),), "touch"),
    Bug("evict_locked", "RadixCache.evict", "evict picks leaves without looking at their lock count, so a running "
        "request's blocks go",
        ((HEAP, HEAP.replace("n.lock_count == 0", "n is not self.root")),
         ("and not parent.children and parent.lock_count == 0:", "and not parent.children:")), "locked"),
    Bug("evict_newest", "RadixCache.evict", "evict frees the most recently used leaf first (a max-heap where a "
        "min-heap belongs)",
        (("heap = [(n.last_access,", "heap = [(-n.last_access,"),
         ("heapq.heappush(heap, (parent.last_access,", "heapq.heappush(heap, (-parent.last_access,")),
        "least recently used"),
    Bug("evict_no_parents", "RadixCache.evict", "evict only considers the leaves it found at the start; a parent "
        "left childless is never evicted", ((PUSH, ""),), "its parent may have become an unlocked leaf"),
    Bug("evict_overshoots", "RadixCache.evict", "evict keeps going after n blocks are free: it empties the cache",
        (("while freed < num_blocks and heap:", "while heap:"),), "only it"),
)

EQUIVALENT = {
}
