"""Attention kernels over the paged KV cache (the CPU's C kernel is in nanoserve/cpu/).

backends.py        which attention backend runs (torch or triton) and building it
reference.py       torch, any device: the contract every kernel is tested against
torch_backend.py   the "torch" backend: reference.py's functions over a step's decodes and chunks
triton_backend.py  the "triton" backend: the Triton kernels' metadata and launches
triton_decode.py   Triton paged decode attention (split-K + combine)
triton_prefill.py  Triton paged prefill over a cached prefix
triton_cache.py    Triton KV store and block copy
triton_common.py   the block-table tile load and online-softmax step both attention kernels share
triton_targets.py  the kernels compiled for sm_80/90/100 without a GPU: registers, spills, shared memory
triton_shapes.py   the shapes they are compiled at: the wrappers called on the engine's real shape grid
checks.py          argument checks that name the bad argument before any launch
"""
