"""Bug: insert walks past blocks the tree already holds without reporting the caller's duplicate copies."""
from nanoserve.radix_cache import RadixCache as _Cache
from nanoserve.radix_cache import RadixNode  # noqa: F401

EXPECT_HINT = "duplicate prefix block is freed"


class RadixCache(_Cache):
    def insert(self, seq_id, tokens, block_ids):
        node, _ = super().insert(seq_id, tokens, block_ids)
        return node, []
