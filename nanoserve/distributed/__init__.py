"""Across processes: tensor parallelism and prefill/decode disaggregation over torch.distributed.

    group.py           start, watch and stop worker processes and their gloo process group (WorkerDied)
    comm.py            the Communicator: all-reduce, gather, broadcast, send/recv, each counted
    layers.py          column- and row-parallel linears, vocab-parallel embedding and LM head
    sharding.py        split a GPT-2 or Llama into N shards (and say when N does not divide it)
    ledger.py          which token each KV slot of a rank's pool holds: the per-rank invariant check
    messages.py        what the driver sends tensor-parallel workers, and what they report
    rank.py            one rank's shard, pool and ledger, and the worker loop
    tensor_parallel.py the driver's TensorParallelRunner (EngineConfig.tensor_parallel_size > 1)
    kv_transfer.py     packing KV blocks out of one pool and into another
    disaggregated.py   a prefill engine and a decode engine in two processes, KV handed over

Nothing here is imported by `import nanoserve`; the engine imports the
runner only when tensor_parallel_size > 1.
"""

from nanoserve.distributed.group import WorkerDied, WorkerGroup

__all__ = ["WorkerDied", "WorkerGroup"]
