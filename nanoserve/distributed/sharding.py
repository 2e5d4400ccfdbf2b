"""Splitting a loaded model into N shards, one per rank (the standard tensor-parallel split).

`shard_model(model, rank, N)` returns rank `rank`'s model: the same classes
(models/gpt2.py, models/llama.py), the same forward, with

    attention   q, k, v projections column-parallel by *heads*: rank r keeps query heads
                [r Hq/N, (r+1) Hq/N) and KV heads [r Hkv/N, (r+1) Hkv/N); its attention runs
                on those heads only and its KV cache stores only its KV heads.
                The output projection is row-parallel: all-reduce #1 of the layer.
    MLP         up (and gate) column-parallel, down (GPT-2: proj) row-parallel: all-reduce #2.
    embeddings  the token table vocab-parallel (one all-reduce per step); GPT-2's position
                table, the norms and the biases of row-parallel layers are replicated.
    LM head     vocab-parallel, gathered on rank 0 (GPT-2 and tied Llamas share the shard
                with the embedding, as the full model shares the table).

Grouped-query attention splits cleanly: query head h reads KV head
h // (Hq / Hkv), and contiguous slices keep every query head with its KV head
on the same rank. So N must divide both head counts (and the MLP width):
`check_shardable` says so, as a FieldError naming `tensor_parallel_size`,
before any process starts.

The shard is a new module tree sharing the replicated tensors with the full
model; only the split layers hold new (sliced) tensors. Nothing here talks to
other processes: `layers.attach` gives the shard its communicator on the rank.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from nanoserve.distributed.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    VocabParallelHead,
)
from nanoserve.errors import FieldError
from nanoserve.models.gpt2 import GPT2
from nanoserve.models.llama import Llama


def head_counts(model: nn.Module) -> tuple[int, int]:
    """(query heads, KV heads) of a GPT2 or Llama."""
    if isinstance(model, GPT2):
        return model.config.n_head, model.config.n_head
    return model.config.num_attention_heads, model.config.num_key_value_heads


def mlp_width(model: nn.Module) -> int:
    if isinstance(model, GPT2):
        return model.config.n_inner or 4 * model.config.n_embd
    return model.config.intermediate_size


def check_shardable(model: nn.Module, n: int) -> None:
    """FieldError("tensor_parallel_size", ...) unless N splits the heads and the MLP evenly."""
    if not isinstance(model, (GPT2, Llama)):
        raise FieldError("tensor_parallel_size", f"> 1 needs a GPT-2 or Llama model, got {type(model).__name__}")
    hq, hkv = head_counts(model)
    width = mlp_width(model)
    if hq % n or hkv % n or width % n:
        raise FieldError("tensor_parallel_size", f"must divide the model's {hq} attention heads, {hkv} KV heads "
                                                 f"and MLP width {width}, got {n}")


def head_slice(num_heads: int, rank: int, n: int) -> range:
    """The heads rank `rank` owns: a contiguous run of num_heads / n."""
    per = num_heads // n
    return range(rank * per, (rank + 1) * per)


def vocab_slice(vocab_size: int, rank: int, n: int) -> tuple[int, int, int]:
    """(start, end, per_rank): the ids rank `rank` owns; per_rank = ceil(vocab / n) (the last may be short)."""
    per = -(-vocab_size // n)
    start = min(rank * per, vocab_size)
    return start, min(start + per, vocab_size), per


def _rows(heads: range, head_dim: int, offset: int = 0) -> torch.Tensor:
    """Row indices of `heads` in a projection whose rows are heads of `head_dim`, starting at `offset`."""
    return torch.cat([torch.arange(offset + h * head_dim, offset + (h + 1) * head_dim) for h in heads])


def _chunk(width: int, rank: int, n: int) -> torch.Tensor:
    per = width // n
    return torch.arange(rank * per, (rank + 1) * per)


def _clone_tree(module: nn.Module) -> nn.Module:
    """A new module tree with the same tensors (like cpu/linear.py's view), to replace layers in."""
    clone = copy.copy(module)
    clone.__dict__.update({k: copy.copy(v) for k, v in vars(module).items() if isinstance(v, dict)})
    for name, child in module._modules.items():
        clone._modules[name] = None if child is None else _clone_tree(child)
    return clone


def shard_model(model: nn.Module, rank: int, n: int) -> nn.Module:
    """Rank `rank`'s shard of `model` (GPT2 or Llama) for tensor parallelism over `n` ranks."""
    check_shardable(model, n)
    shard = _clone_tree(model)
    hq, hkv = head_counts(model)
    q_heads, kv_heads = head_slice(hq, rank, n), head_slice(hkv, rank, n)
    d = model.head_dim
    if isinstance(model, GPT2):
        hidden = model.config.n_embd
        for block in shard.blocks:
            attn, mlp = block.attn, block.mlp
            # qkv rows: [q heads | k heads | v heads], each hidden wide; keep our heads of all three
            rows = torch.cat([_rows(q_heads, d, part * hidden) for part in range(3)])
            attn.qkv, attn.out = ColumnParallelLinear(attn.qkv, rows), RowParallelLinear(attn.out, _rows(q_heads, d))
            attn.num_heads = len(q_heads)
            cols = _chunk(mlp_width(model), rank, n)
            mlp.fc, mlp.proj = ColumnParallelLinear(mlp.fc, cols), RowParallelLinear(mlp.proj, cols)
        shard.wte, shard.lm_head = _vocab(model.wte, model.config.vocab_size, rank, n, tied=True)
    else:
        for layer in shard.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            attn.q_proj = ColumnParallelLinear(attn.q_proj, _rows(q_heads, d))
            attn.k_proj = ColumnParallelLinear(attn.k_proj, _rows(kv_heads, d))
            attn.v_proj = ColumnParallelLinear(attn.v_proj, _rows(kv_heads, d))
            attn.o_proj = RowParallelLinear(attn.o_proj, _rows(q_heads, d))
            attn.num_heads, attn.num_kv_heads = len(q_heads), len(kv_heads)
            cols = _chunk(mlp_width(model), rank, n)
            mlp.gate_proj = ColumnParallelLinear(mlp.gate_proj, cols)
            mlp.up_proj = ColumnParallelLinear(mlp.up_proj, cols)
            mlp.down_proj = RowParallelLinear(mlp.down_proj, cols)
        embed, head = _vocab(model.model.embed_tokens, model.config.vocab_size, rank, n,
                             tied=model.tie_word_embeddings, lm_head=model.lm_head)
        shard.model.embed_tokens, shard.lm_head = embed, head
    shard.num_kv_heads = len(kv_heads)        # the runner sizes this rank's KV cache from it
    shard.tp_rank, shard.tp_size = rank, n
    shard.kv_heads = tuple(kv_heads)          # which of the model's KV heads this rank's cache holds
    return shard


def _vocab(embedding: nn.Embedding, vocab_size: int, rank: int, n: int, tied: bool,
           lm_head: nn.Linear | None = None) -> tuple[VocabParallelEmbedding, VocabParallelHead]:
    """The vocab-parallel embedding and LM head of rank `rank` (one shared weight when tied)."""
    start, end, per = vocab_slice(vocab_size, rank, n)
    embed = VocabParallelEmbedding(embedding, start, end, per)
    if tied:
        weight = embed.weight
    else:
        weight = lm_head.weight.new_zeros(per, lm_head.in_features)
        weight[: end - start] = lm_head.weight.detach()[start:end]
        weight = nn.Parameter(weight, requires_grad=False)
    return embed, VocabParallelHead(weight, vocab_size, start, end)


# -- describing a split (for pictures and lessons) ---------------------------------------------------

def describe_shard(shard: nn.Module, layer: int = 0) -> list[dict]:
    """Plain data about one rank's shard: each weight of layer `layer` and the vocab-parallel ends,
    with its full shape, this rank's shape, the rows/columns/ids it owns, and the collective after it."""
    from nanoserve.distributed.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

    if isinstance(shard, GPT2):
        block = shard.blocks[layer]
        names = [("wte", shard.wte), ("qkv", block.attn.qkv), ("out", block.attn.out),
                 ("fc", block.mlp.fc), ("proj", block.mlp.proj), ("lm_head", shard.lm_head)]
    else:
        a, m = shard.model.layers[layer].self_attn, shard.model.layers[layer].mlp
        names = [("embed_tokens", shard.model.embed_tokens), ("q_proj", a.q_proj), ("k_proj", a.k_proj),
                 ("v_proj", a.v_proj), ("o_proj", a.o_proj), ("gate_proj", m.gate_proj), ("up_proj", m.up_proj),
                 ("down_proj", m.down_proj), ("lm_head", shard.lm_head)]
    out = []
    for name, module in names:
        if isinstance(module, ColumnParallelLinear):
            out.append(dict(name=name, kind="column", full=module.full_shape, shape=tuple(module.weight.shape),
                            owned=module.owned, axis="rows", collective=None))
        elif isinstance(module, RowParallelLinear):
            out.append(dict(name=name, kind="row", full=module.full_shape, shape=tuple(module.linear.weight.shape),
                            owned=module.owned, axis="columns", collective="all-reduce"))
        elif isinstance(module, VocabParallelEmbedding):
            out.append(dict(name=name, kind="vocab", full=(module.num_embeddings, module.weight.shape[1]),
                            shape=tuple(module.weight.shape), owned=((module.start, module.end),), axis="ids",
                            collective="all-reduce"))
        else:   # the vocab-parallel head
            out.append(dict(name=name, kind="vocab", full=(module.vocab_size, module.weight.shape[1]),
                            shape=tuple(module.weight.shape), owned=((module.start, module.end),), axis="ids",
                            collective="gather to rank 0"))
    return out


def split_plan(model: nn.Module, n: int, layer: int = 0) -> dict:
    """Plain data about the whole split over `n` ranks, for viewers (viz/tp_dot.py draws it): the
    model's head counts and sizes, and per rank its KV heads and `describe_shard` of layer `layer`."""
    hq, hkv = head_counts(model)
    shards = [shard_model(model, r, n) for r in range(n)]
    return dict(model=type(model).__name__, layer=layer, num_heads=hq, num_kv_heads=hkv, head_dim=model.head_dim,
                num_layers=model.num_layers, element_size=next(model.parameters()).element_size(),
                ranks=[dict(kv_heads=tuple(s.kv_heads), weights=describe_shard(s, layer)) for s in shards])
