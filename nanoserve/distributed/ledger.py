"""The slot ledger: which token, at which position, each KV slot of one rank's pool was computed from.

Every rank keeps its own KV pool, and nothing but the driver's messages
keeps the pools in step: the same block tables, the same copy-on-write
copies, the same swaps, in the same order. If one rank skipped a copy or
swapped the wrong blocks, its attention would quietly read someone else's
K/V. The ledger makes that checkable. Next to the KV tensors each rank keeps

    slots     [num_blocks * block_size, 2] int64: (token id, position) written into each slot
    cpu_slots [num_cpu_blocks * block_size, 2]     the same for the CPU swap space

and updates it with exactly the operations it applies to its KV: a forward
writes (input_ids, positions) at the slot mapping; a copy or a swap moves
whole blocks of it. (-1, -1) marks a slot never written.

`check(expected)` takes what the driver's bookkeeping says (for each live
sequence: its block table and the tokens whose KV it claims to have; for
each prefix-cache node: its blocks and tokens) and lists every slot that
disagrees. `digest()` hashes the whole ledger: equal on every rank when the
ranks applied the same operations, which the driver checks too.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

UNWRITTEN = -1


@dataclass(slots=True)
class ExpectedKV:
    """What the driver says one block table holds: the first len(token_ids) tokens of a sequence."""

    owner: str                    # a request id, or "radix node 7"
    block_table: list[int]
    token_ids: list[int]          # position i holds token_ids[i] (positions start at `start`)
    start: int = 0                # position of token_ids[0]: 0, or a radix node's depth (whole blocks)
    on_cpu: bool = False          # a swapped sequence: the table is CPU blocks


class SlotLedger:
    def __init__(self, num_blocks: int, block_size: int, num_cpu_blocks: int = 0) -> None:
        self.block_size = block_size
        self.slots = torch.full((num_blocks * block_size, 2), UNWRITTEN, dtype=torch.int64)
        self.cpu_slots = torch.full((num_cpu_blocks * block_size, 2), UNWRITTEN, dtype=torch.int64)

    def _blocks(self, on_cpu: bool = False) -> torch.Tensor:
        """The ledger viewed block by block: [blocks, block_size, 2]."""
        return (self.cpu_slots if on_cpu else self.slots).view(-1, self.block_size, 2)

    def allocate_swap(self, num_cpu_blocks: int) -> None:
        self.cpu_slots = torch.full((num_cpu_blocks * self.block_size, 2), UNWRITTEN, dtype=torch.int64)

    # -- the operations a rank applies to its KV ---------------------------------------------

    def write(self, slot_mapping: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor) -> set[int]:
        """A forward stored K/V of input_ids[t] (at positions[t]) into slot_mapping[t]; returns the blocks written."""
        slots = slot_mapping.cpu()
        self.slots[slots] = torch.stack([input_ids.cpu(), positions.cpu()], dim=1)
        return set((slots // self.block_size).tolist())

    def copy(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: block dst now holds what block src holds."""
        if pairs:
            blocks = self._blocks()
            blocks[[d for _, d in pairs]] = blocks[[s for s, _ in pairs]]

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """(device block, CPU block) pairs."""
        if pairs:
            self._blocks(on_cpu=True)[[c for _, c in pairs]] = self._blocks()[[g for g, _ in pairs]]

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """(CPU block, device block) pairs."""
        if pairs:
            self._blocks()[[g for _, g in pairs]] = self._blocks(on_cpu=True)[[c for c, _ in pairs]]

    # -- checks -----------------------------------------------------------------------------

    def check(self, expected: list[ExpectedKV], limit: int = 5) -> list[str]:
        """Every (up to `limit`) disagreement between the ledger and the driver's claims."""
        problems: list[str] = []
        bs = self.block_size
        for e in expected:
            n = len(e.token_ids)
            if not n:
                continue
            pos = torch.arange(e.start, e.start + n)
            table = torch.tensor(e.block_table, dtype=torch.int64)
            local = pos - e.start                              # offsets from the table's first block
            if int(local[-1]) // bs >= len(e.block_table):
                problems.append(f"{e.owner}: {len(e.block_table)} blocks cannot hold {n} tokens")
                continue
            slots = table[local // bs] * bs + local % bs
            held = (self.cpu_slots if e.on_cpu else self.slots)[slots]                    # [n, 2]
            want = torch.stack([torch.tensor(e.token_ids, dtype=torch.int64), pos], dim=1)
            bad = (held != want).any(dim=1).nonzero().flatten()
            for i in bad[:limit].tolist():
                where = "CPU slot" if e.on_cpu else "slot"
                problems.append(f"{e.owner}: position {int(pos[i])} should be token {e.token_ids[i]} in {where} "
                                f"{int(slots[i])}, which holds token {int(held[i, 0])} at position {int(held[i, 1])}")
            if len(problems) >= limit:
                break
        return problems[:limit]

    def digest(self) -> str:
        """A short hash of the whole ledger (device and CPU slots)."""
        h = hashlib.sha256(self.slots.numpy().tobytes())
        h.update(self.cpu_slots.numpy().tobytes())
        return h.hexdigest()[:12]
