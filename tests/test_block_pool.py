"""BlockPool and FreeBlockQueue: unit tests, a Hypothesis state machine against a
plain-list model, and proof that `check_invariants` fails on corrupted bookkeeping."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from nanoserve.block_pool import Block, BlockPool, FreeBlockQueue

# -- unit tests --------------------------------------------------------------------------


def test_rejects_empty_pool():
    with pytest.raises(ValueError):
        BlockPool(0, 4)
    with pytest.raises(ValueError):
        BlockPool(4, 0)


def test_fresh_pool_is_all_free_in_id_order():
    pool = BlockPool(5, 4)
    assert pool.free_queue.ids() == [0, 1, 2, 3, 4]
    assert pool.num_free_blocks == 5 and pool.num_used_blocks == 0
    pool.check_invariants([])


def test_allocate_pops_from_head_in_lru_order():
    pool = BlockPool(6, 4)
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(3) == [2, 3, 4]
    assert pool.free_queue.ids() == [5]
    assert [pool.blocks[i].ref_count for i in range(6)] == [1, 1, 1, 1, 1, 0]
    assert pool.allocate(0) == []
    pool.check_invariants([[0, 1], [2, 3, 4]])


def test_free_appends_in_reverse_so_last_block_is_reused_first():
    pool = BlockPool(6, 4)
    a = pool.allocate(3)          # [0, 1, 2]
    released = pool.free(a)
    assert released == [2, 1, 0]
    # Still-free blocks 3, 4, 5 come first (freed longest ago), then a's blocks last-first.
    assert pool.free_queue.ids() == [3, 4, 5, 2, 1, 0]
    pool.allocate(3)
    assert pool.allocate(1) == [2]   # the request's last block is the first of its blocks to be reused
    pool.check_invariants([[3, 4, 5], [2]])


def test_free_of_shared_block_only_drops_a_holder():
    pool = BlockPool(4, 4)
    a = pool.allocate(2)
    pool.share(a)
    assert pool.free(a) == []                      # still held by the other table
    assert pool.num_free_blocks == 2
    pool.check_invariants([a])
    assert pool.free(a) == [1, 0]
    pool.check_invariants([])


def test_double_free_raises():
    pool = BlockPool(4, 4)
    a = pool.allocate(2)
    pool.free(a)
    before = pool.snapshot()
    with pytest.raises(ValueError, match="double free"):
        pool.free(a)
    assert pool.snapshot() == before
    with pytest.raises(ValueError, match="double free"):
        pool.free([3])                             # never allocated at all


def test_allocate_more_than_free_raises_and_changes_nothing():
    pool = BlockPool(5, 4)
    held = pool.allocate(3)
    pool.free(held[1:2])
    before = pool.snapshot()
    with pytest.raises(MemoryError):
        pool.allocate(4)
    assert pool.snapshot() == before
    table = [held[0]]
    with pytest.raises(MemoryError):
        pool.append_slots(table, 4 * 6)            # needs 5 more blocks, 3 free
    assert table == [held[0]]
    assert pool.snapshot() == before
    pool.check_invariants([[held[0]], [held[2]]])


@pytest.mark.parametrize("block_size", [1, 3, 4, 16])
def test_append_slots_grows_to_exactly_ceil(block_size):
    pool = BlockPool(64, block_size)
    table: list[int] = []
    for num_tokens in [0, 1, 1, 2, block_size, block_size + 1, 3 * block_size - 1, 3 * block_size, 50, 7]:
        before = list(table)
        expected_len = max(len(before), -(-num_tokens // block_size))
        new = pool.append_slots(table, num_tokens)
        assert table == before + new                # grows in place, never shrinks or reorders
        assert len(table) == expected_len
        if num_tokens >= len(before) * block_size:
            assert len(table) == -(-num_tokens // block_size)
        pool.check_invariants([table])


def test_blocks_needed():
    pool = BlockPool(8, 4)
    assert pool.blocks_needed(0, 0) == 0
    assert pool.blocks_needed(0, 1) == 1
    assert pool.blocks_needed(0, 4) == 1
    assert pool.blocks_needed(0, 5) == 2
    assert pool.blocks_needed(2, 5) == 0
    assert pool.blocks_needed(3, 5) == 0            # never negative
    assert pool.blocks_needed(1, 9) == 2


def test_share_increments_and_rejects_free_blocks():
    pool = BlockPool(4, 4)
    a = pool.allocate(2)
    pool.share(a)
    pool.share(a[:1])
    assert [pool.blocks[i].ref_count for i in a] == [3, 2]
    pool.check_invariants([a, a, a[:1]])
    with pytest.raises(ValueError):
        pool.share([3])                             # free block
    assert pool.blocks[3].ref_count == 0


def test_free_queue_remove_from_middle_head_and_tail():
    blocks = [Block(i) for i in range(6)]
    q = FreeBlockQueue(blocks)
    q.remove(blocks[3])
    assert q.ids() == [0, 1, 2, 4, 5] and len(q) == 5
    assert blocks[3].prev is None and blocks[3].next is None
    q.remove(blocks[0])                             # head
    q.remove(blocks[5])                             # tail
    assert q.ids() == [1, 2, 4] and len(q) == 3
    # Links stay consistent in both directions.
    assert q.head.next is blocks[1] and blocks[1].prev is q.head
    assert blocks[2].next is blocks[4] and blocks[4].prev is blocks[2]
    assert blocks[4].next is q.tail and q.tail.prev is blocks[4]
    q.append(blocks[3])
    assert q.ids() == [1, 2, 4, 3]
    assert q.popleft() is blocks[1]
    for _ in range(3):
        q.popleft()
    assert len(q) == 0 and q.ids() == []
    assert q.head.next is q.tail and q.tail.prev is q.head
    with pytest.raises(IndexError):
        q.popleft()


def test_snapshot_is_plain_data():
    pool = BlockPool(3, 2)
    t = pool.allocate(2)
    pool.share(t[:1])
    snap = pool.snapshot()
    assert snap == {"num_blocks": 3, "block_size": 2, "ref_counts": [2, 1, 0], "free_queue": [2]}


# -- check_invariants must be able to fail ------------------------------------------------


def _pool_with_tables():
    pool = BlockPool(8, 4)
    a = pool.allocate(3)
    b = pool.allocate(2)
    pool.share(a[:2])
    c = a[:2]
    pool.free(b)
    tables = [a, c]
    pool.check_invariants(tables)
    return pool, tables


def test_check_invariants_catches_bumped_ref_count():
    pool, tables = _pool_with_tables()
    pool.blocks[tables[0][2]].ref_count += 1
    with pytest.raises(AssertionError, match="ref_count"):
        pool.check_invariants(tables)


def test_check_invariants_catches_missing_holder():
    pool, tables = _pool_with_tables()
    with pytest.raises(AssertionError):
        pool.check_invariants(tables[:1])          # c's holds are not accounted for


def test_check_invariants_catches_table_holding_free_block():
    pool, tables = _pool_with_tables()
    free_id = pool.free_queue.ids()[0]
    with pytest.raises(AssertionError):
        pool.check_invariants(tables + [[free_id]])


def test_check_invariants_catches_used_block_in_free_queue():
    pool, tables = _pool_with_tables()
    pool.free_queue.append(pool.blocks[tables[0][2]])   # ref count 1, yet listed as free
    with pytest.raises(AssertionError):
        pool.check_invariants(tables)


def test_check_invariants_catches_free_block_missing_from_queue():
    pool, tables = _pool_with_tables()
    pool.free_queue.popleft()                       # ref count 0 but no longer in the queue: leaked
    with pytest.raises(AssertionError):
        pool.check_invariants(tables)


def test_check_invariants_catches_duplicate_in_free_queue():
    pool, tables = _pool_with_tables()
    pool.free_queue.append(Block(pool.free_queue.ids()[0]))   # same id twice
    with pytest.raises(AssertionError):
        pool.check_invariants(tables)


def test_check_invariants_catches_bad_queue_size():
    pool, tables = _pool_with_tables()
    pool.free_queue.size += 1
    with pytest.raises(AssertionError):
        pool.check_invariants(tables)


def test_check_invariants_catches_zeroed_ref_count_of_held_block():
    pool, tables = _pool_with_tables()
    pool.blocks[tables[0][0]].ref_count = 0
    with pytest.raises(AssertionError):
        pool.check_invariants(tables)


@pytest.mark.parametrize("bad_id", [99, -1])
def test_check_invariants_catches_table_holding_nonexistent_block(bad_id):
    pool, tables = _pool_with_tables()
    with pytest.raises(AssertionError):
        pool.check_invariants(tables + [[bad_id]])


# -- Hypothesis state machine ----------------------------------------------------------------


class BlockPoolMachine(RuleBasedStateMachine):
    """Random allocate / grow / share / free sequences against a list model of the free queue."""

    @initialize(num_blocks=st.integers(1, 24), block_size=st.sampled_from([1, 2, 4, 16]))
    def setup(self, num_blocks, block_size):
        self.pool = BlockPool(num_blocks, block_size)
        self.tables: dict[int, list[int]] = {}     # table id -> block ids (the engine's block tables)
        self.model_free: list[int] = list(range(num_blocks))   # head first
        self.model_refs = [0] * num_blocks
        self.next_id = 0

    # helpers ------------------------------------------------------------------

    def _model_allocate(self, n: int) -> list[int]:
        ids, self.model_free = self.model_free[:n], self.model_free[n:]
        for i in ids:
            self.model_refs[i] = 1
        return ids

    def _pick(self, data) -> int:
        return data.draw(st.sampled_from(sorted(self.tables)))

    # rules ----------------------------------------------------------------------

    @rule(n=st.integers(0, 30))
    def allocate(self, n):
        if n > len(self.model_free):
            before = self.pool.snapshot()
            with pytest.raises(MemoryError):
                self.pool.allocate(n)
            assert self.pool.snapshot() == before
            return
        ids = self.pool.allocate(n)
        assert ids == self._model_allocate(n)
        self.tables[self.next_id] = ids
        self.next_id += 1

    @precondition(lambda self: self.tables)
    @rule(data=st.data(), extra_tokens=st.integers(0, 40))
    def append_slots(self, data, extra_tokens):
        tid = self._pick(data)
        table = self.tables[tid]
        bs = self.pool.block_size
        # Tokens the table already covers, give or take a partly filled last block, plus more.
        num_tokens = max(0, len(table) * bs - data.draw(st.integers(0, bs - 1))) + extra_tokens
        need = max(0, -(-num_tokens // bs) - len(table))
        before_table = list(table)
        if need > len(self.model_free):
            before = self.pool.snapshot()
            with pytest.raises(MemoryError):
                self.pool.append_slots(table, num_tokens)
            assert table == before_table and self.pool.snapshot() == before
            return
        new = self.pool.append_slots(table, num_tokens)
        assert new == self._model_allocate(need)
        assert table == before_table + new
        assert len(table) == max(len(before_table), -(-num_tokens // bs))

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def share(self, data):
        tid = self._pick(data)
        src = self.tables[tid]
        # A fork shares a prefix of the table (possibly all of it).
        k = data.draw(st.integers(0, len(src)))
        self.pool.share(src[:k])
        for i in src[:k]:
            self.model_refs[i] += 1
        self.tables[self.next_id] = list(src[:k])
        self.next_id += 1

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def free(self, data):
        tid = self._pick(data)
        table = self.tables.pop(tid)
        released = self.pool.free(table)
        expected = []
        for i in reversed(table):
            self.model_refs[i] -= 1
            if self.model_refs[i] == 0:
                expected.append(i)
        assert released == expected
        self.model_free.extend(expected)

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def double_free(self, data):
        """Freeing a block nobody holds raises (a freed table's blocks, freed again)."""
        free_ids = self.pool.free_queue.ids()
        if not free_ids:
            return
        block_id = data.draw(st.sampled_from(free_ids))
        with pytest.raises(ValueError):
            self.pool.free([block_id])

    # invariants ------------------------------------------------------------------

    @invariant()
    def pool_invariants(self):
        self.pool.check_invariants(self.tables.values())

    @invariant()
    def matches_model(self):
        assert self.pool.free_queue.ids() == self.model_free
        assert [b.ref_count for b in self.pool.blocks] == self.model_refs
        assert self.pool.num_free_blocks == len(self.model_free)
        assert self.pool.num_used_blocks == self.pool.num_blocks - len(self.model_free)

    def teardown(self):
        # Freeing every table returns every block.
        for table in self.tables.values():
            self.pool.free(table)
        self.pool.check_invariants([])
        assert self.pool.num_free_blocks == self.pool.num_blocks


BlockPoolMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestBlockPoolMachine = BlockPoolMachine.TestCase


def test_free_is_all_or_nothing_and_rejects_bad_ids():
    pool = BlockPool(num_blocks=4, block_size=2)
    ids = pool.allocate(2)
    before = pool.snapshot()
    for bad in ([ids[0], ids[0]], [-1], [99], [ids[0], 3]):
        with pytest.raises(ValueError):
            pool.free(bad)
        assert pool.snapshot() == before
    with pytest.raises(ValueError):
        pool.allocate(-1)


def test_check_invariants_catches_a_broken_prev_link():
    pool = BlockPool(num_blocks=4, block_size=2)
    pool.blocks[2].prev = pool.blocks[0]
    with pytest.raises(AssertionError, match="prev link"):
        pool.check_invariants([])


def test_cyclic_free_queue_does_not_hang():
    pool = BlockPool(num_blocks=4, block_size=2)
    pool.blocks[3].next = pool.blocks[1]          # a loop instead of the tail
    with pytest.raises(AssertionError):
        pool.check_invariants([])
