"""Tensor-parallel layers: each rank holds a slice of a weight and computes its part of the layer.

The standard split (Megatron-LM, Shoeybi et al. 2019; vLLM's
`ColumnParallelLinear` / `RowParallelLinear`) for y = x @ W.T, W of shape
[out, in]:

    column parallel   rank r keeps some *output* rows of W: W_r = W[rows_r]
                      y_r = x @ W_r.T is rank r's own slice of y; nothing to communicate.
                      (QKV: the rows of rank r's heads; gate/up: a slice of the MLP width.)

    row parallel      rank r keeps some *input* columns of W: W_r = W[:, cols_r]
                      x arrives already split (x_r: the output of a column-parallel layer),
                      y = sum_r x_r @ W_r.T: each rank has a partial sum, and an
                      **all-reduce** adds them up on every rank. The bias is added once, after.
                      (The attention output projection and the MLP's down projection.)

So an attention block or an MLP costs exactly one all-reduce: column then
row, with the nonlinearity (attention, SiLU/GELU) in between running on the
slices, because it works head by head or element by element.

The vocabulary is split the same way, in contiguous ranges of token ids:

    vocab-parallel embedding   rank r holds the rows of ids [start_r, end_r); a token outside
                               its range looks up zeros, and an all-reduce sums the one real row.
    vocab-parallel LM head     rank r computes the logits of its ids; rank 0 **gathers** the
                               slices and concatenates them into the full row.

The vocabulary is padded to a multiple of N with zero rows (their logits are
dropped), so every rank's slice has the same size, as a gather wants.

A layer reaches its process group through `self.comm`, set on the rank by
`attach()` after the shard arrived (a Communicator cannot be pickled).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class ColumnParallelLinear(nn.Linear):
    """The output rows `rows` of a full nn.Linear: y_r = x @ W[rows].T + b[rows]. No communication."""

    def __init__(self, full: nn.Linear, rows: torch.Tensor) -> None:
        super().__init__(full.in_features, len(rows), bias=full.bias is not None,
                         device=full.weight.device, dtype=full.weight.dtype)
        with torch.no_grad():
            self.weight.copy_(full.weight[rows])
            if full.bias is not None:
                self.bias.copy_(full.bias[rows])
        self.full_shape = tuple(full.weight.shape)          # [out, in] of the whole layer
        self.owned = _ranges(rows.tolist())                 # the output rows this rank keeps


class RowParallelLinear(nn.Module):
    """The input columns `cols` of a full nn.Linear; partial outputs summed over ranks by an all-reduce."""

    def __init__(self, full: nn.Linear, cols: torch.Tensor) -> None:
        super().__init__()
        self.linear = nn.Linear(len(cols), full.out_features, bias=False,
                                device=full.weight.device, dtype=full.weight.dtype)
        with torch.no_grad():
            self.linear.weight.copy_(full.weight[:, cols])
        # The bias is not split: every rank adds it once, after the sum.
        self.bias = None if full.bias is None else nn.Parameter(full.bias.detach().clone(), requires_grad=False)
        self.full_shape = tuple(full.weight.shape)
        self.owned = _ranges(cols.tolist())                 # the input columns this rank keeps
        self.comm = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:      # x [T, in / N] -> [T, out]
        y = self.linear(x)                                   # this rank's partial sum
        self.comm.all_reduce(y)                              # everyone's sum, on every rank
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Rows [start, end) of an embedding table (padded to `per_rank`); other ids look up zeros, then all-reduce."""

    def __init__(self, full: nn.Embedding, start: int, end: int, per_rank: int) -> None:
        super().__init__()
        weight = full.weight.new_zeros(per_rank, full.embedding_dim)
        weight[: end - start] = full.weight.detach()[start:end]
        self.weight = nn.Parameter(weight, requires_grad=False)     # [per_rank, hidden]
        self.start, self.end = start, end
        self.num_embeddings = full.num_embeddings
        self.comm = None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:    # ids [T] -> [T, hidden]
        local = ids - self.start
        outside = (local < 0) | (local >= self.end - self.start)
        h = F.embedding(local.masked_fill(outside, 0), self.weight)
        h[outside] = 0                                       # not ours: some other rank has this row
        self.comm.all_reduce(h)                              # exactly one rank contributed each row
        return h


class VocabParallelHead(nn.Module):
    """Logits of ids [start, end) on each rank; rank 0 gathers and concatenates the full [N, vocab]."""

    def __init__(self, weight: nn.Parameter, vocab_size: int, start: int, end: int) -> None:
        super().__init__()
        self.weight = weight                                 # [per_rank, hidden], maybe the embedding's (tied)
        self.vocab_size = vocab_size
        self.start, self.end = start, end
        self.comm = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:   # [S, hidden] -> [S, vocab] on rank 0
        local = F.linear(hidden, self.weight).float()          # [S, per_rank]: this rank's ids' logits
        parts = self.comm.gather_to_driver(local)
        if parts is None:
            return local                                       # a worker: rank 0 has the full row
        return torch.cat(parts, dim=-1)[:, : self.vocab_size]  # drop the padding ids


PARALLEL_LAYERS = (RowParallelLinear, VocabParallelEmbedding, VocabParallelHead)


def attach(model: nn.Module, comm) -> nn.Module:
    """Give every layer that communicates this rank's Communicator."""
    for module in model.modules():
        if isinstance(module, PARALLEL_LAYERS):
            module.comm = comm
    return model


def _ranges(indices: list[int]) -> tuple[tuple[int, int], ...]:
    """[0, 1, 2, 8, 9] -> ((0, 3), (8, 10)): sorted indices as half-open runs, for pictures."""
    runs: list[list[int]] = []
    for i in indices:
        if runs and runs[-1][1] == i:
            runs[-1][1] = i + 1
        else:
            runs.append([i, i + 1])
    return tuple((a, b) for a, b in runs)
