"""Bug: match_prefix may match every block of the prompt, leaving no token to compute."""
from nanoserve.radix_cache import RadixCache as _Cache
from nanoserve.radix_cache import RadixNode  # noqa: F401

EXPECT_HINT = "leaves nothing to compute"


class RadixCache(_Cache):
    def match_prefix(self, tokens):
        max_blocks = len(tokens) // self.block_size          # the bug: no "- 1"
        node, blocks = self.root, []
        while len(blocks) < max_blocks:
            child = node.children.get(self._key(tokens, len(blocks)))
            if child is None:
                break
            n = self._common_blocks(child, tokens, len(blocks), max_blocks - len(blocks))
            if n < len(child.block_ids):
                child = self._split(child, n)
            blocks += child.block_ids
            node = child
        return node, blocks
