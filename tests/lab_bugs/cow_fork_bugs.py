"""Known bugs of the cow-fork lab (nanoserve/kv_manager.py), and its equivalent mutants. See make.py."""

from make import Bug

BUGS = (
    Bug("copies_full_blocks", "KVManager._shared_write_block", "_shared_write_block ignores whether the block is "
        "partly filled, so a fork at a boundary copies a full block",
        (("if seq.num_computed_tokens % bs and i < len(seq.block_table)", "if i < len(seq.block_table)"),),
        "boundary"),
    Bug("block_of_last_token", "KVManager._shared_write_block", "_shared_write_block looks at the block of the "
        "last token written, not the next: at a boundary that is the full block before it",
        (("        i = seq.num_computed_tokens // bs\n        if seq.num_computed_tokens % bs and i < len(seq.block_table)",
          "        i = (seq.num_computed_tokens - 1) // bs\n        if i < len(seq.block_table)"),), "a boundary"),
    Bug("last_block_skipped", "KVManager._shared_write_block", "_shared_write_block stops one block short of the "
        "table's end, so the partly filled last block (the one a fork shares) is never copied",
        (("i < len(seq.block_table)", "i < len(seq.block_table) - 1"),), "held twice"),
    Bug("forgets_partial", "KVManager._shared_write_block", "copy-on-write never fires: a shared, partly filled last "
        "block is written by both sequences", (("            return i\n", "            return None\n"),),
        "held twice"),
    Bug("ignores_ref_count", "KVManager._shared_write_block", "_shared_write_block asks for a copy of a block only "
        "this sequence holds", (("ref_count > 1", "ref_count >= 1"),), "held only by this table"),
    Bug("copy_not_listed", "KVManager.copy_on_write", "copy_on_write switches to a fresh block but never asks the "
        "runner to copy the KV into it", (("        self.moves.copies.append((src, dst))\n", ""),),
        "self.moves.copies"),
    Bug("cow_keeps_source", "KVManager.copy_on_write", "copy_on_write takes a copy but never lets go of the shared "
        "block (a leaked holder)", (("        self.pool.free([src])                  # one holder fewer; the others "
                                     "keep it\n", ""),), "free it once"),
    Bug("cow_frees_first", "KVManager.copy_on_write", "copy_on_write lets go of the shared block before it has a "
        "new one: when the pool is full, the table keeps a block it no longer holds",
        (("        dst = self._take(1)[0]\n        self.pool.free([src])                  # one holder fewer; the "
          "others keep it\n",
          "        self.pool.free([src])\n        dst = self._take(1)[0]\n"),), "BEFORE letting go"),
    Bug("fork_no_share", "KVManager.fork", "fork copies the parent's table but adds no holder to its blocks",
        (("        self.pool.share(parent.block_table)\n", ""),), "fork must share"),
    Bug("fork_aliases_table", "KVManager.fork", "fork hands the child the parent's own list: a block appended to "
        "one table appears in both", (("child.block_table = list(parent.block_table)",
                                       "child.block_table = parent.block_table"),), "same list object"),
    Bug("fork_forgets_computed", "KVManager.fork", "the child starts with no KV computed, though it shares all of "
        "the parent's", (("        child.num_computed_tokens = parent.num_computed_tokens\n", ""),),
        "num_computed_tokens"),
    Bug("fork_no_lock", "KVManager.fork", "fork does not lock the parent's cached prefix for the child: it can be "
        "evicted under the child", (("        if parent.cache_node is not None:\n"
                                     "            self._relock(child, parent.cache_node)\n", ""),), "lock"),
)

EQUIVALENT = {
    'KVManager._shared_write_block:drop: return None :: return None -> pass':
        "the function's last statement: falling off its end returns None all the same",
    'KVManager.copy_on_write:constant: dst = self._take(1)[0] :: 0 -> -1':
        '_take(1) returns a list of exactly one block: [0] and [-1] are the same item',
}
