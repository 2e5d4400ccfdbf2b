"""fold: events -> view state.

This module owns `fold(state, event)`, which applies one event to a
`ViewState` (see `view.py`) the way the engine applied the decision to its
own bookkeeping, `fold_all(events)`, and `synced_event(snapshot)`, which turns
`engine.snapshot()` into the EngineSynced event a fold starts from.

Block events mirror `block_pool.py`: taking a block unlinks it from wherever
it sits in the free queue; freeing drops one holder per block, then appends
the released ones to the tail in the event's order. Tree events mirror
`radix_cache.py`: the tree holds one reference on each block of each node.

It leaves deciding to the engine and drawing to viz/ and tui/. It imports
nothing but `events.py` and `view.py`.
"""

from __future__ import annotations

from nanoserve import events as ev
from nanoserve.fold_groups import fold_group_event, forget_evicted, is_group_event, shared_groups
from nanoserve.view import (
    FINISHED_STATUS,
    HISTORY_LEN,
    ROOT,
    GrammarView,
    RadixNodeView,
    RankView,
    SequenceView,
    TransferView,
    ViewState,
)


def synced_event(snapshot: dict) -> ev.EngineSynced:
    """`engine.snapshot()` as an EngineSynced event, sequences in queue order (running, waiting, swapped).

    Keys added with the memory mechanisms ("radix", "cpu_pool", "swapped",
    a sequence's "cache_node" and "cpu_block_table") are optional, and the names
    from before the request/sequence rename ("requests", "request_id") are read
    too, so older snapshots still convert.
    """
    pool = snapshot["pool"]
    listed = snapshot["sequences"] if "sequences" in snapshot else snapshot["requests"]
    by_id = {r.get("seq_id", r.get("request_id")): r for r in listed}
    order = list(snapshot["running"]) + list(snapshot["waiting"]) + list(snapshot.get("swapped", ()))
    sequences = tuple(
        (r.get("seq_id", r.get("request_id")), r["status"], r["prompt"], r["num_prompt_tokens"], r["output_text"],
         r["num_output_tokens"], r["num_computed_tokens"], tuple(r["block_table"]), r["max_tokens"],
         r.get("cache_node", ROOT), tuple(r.get("cpu_block_table", ())))
        + ((r["grammar"],) if "grammar" in r else ())     # structured output's kind (newer snapshots)
        for r in (by_id[rid] for rid in order)
    )
    radix = snapshot.get("radix") or {}
    nodes = tuple((n["node_id"], n["parent_id"], n["text"], n["num_tokens"], tuple(n["block_ids"]),
                   n["last_access"]) for n in radix.get("nodes", ()))
    cpu_pool = snapshot.get("cpu_pool") or {}
    ranks = tuple((r["rank"], tuple(r["kv_heads"]), r["bytes_per_block"]) for r in snapshot.get("ranks", ()))
    return ev.EngineSynced(snapshot["step"], snapshot["model"], pool["num_blocks"], pool["block_size"],
                           tuple(pool["ref_counts"]), tuple(pool["free_queue"]), sequences, nodes,
                           bool(radix.get("enabled", False)), cpu_pool.get("num_blocks", 0), ranks,
                           tuple(dict(snapshot.get("config", {})).items()),
                           tuple(dict(snapshot.get("implementation", {})).items()),
                           radix.get("num_hit_tokens", 0), radix.get("num_lookup_tokens", 0),
                           *_synced_groups(snapshot, order, by_id), trace_version=ev.TRACE_VERSION)


def _synced_groups(snapshot: dict, order: list[str], by_id: dict) -> tuple:
    """EngineSynced's KV cache group fields from a snapshot: all empty for one group (kv_groups.py)."""
    groups = snapshot.get("kv_groups") or []
    if len(groups) <= 1:
        return (), (), ()
    tables = tuple((rid, tuple(map(tuple, by_id[rid].get("group_tables", ()))),
                    tuple(map(tuple, by_id[rid].get("cpu_group_tables", ())))) for rid in order)
    companions = tuple((b, tuple(c)) for b, c in (snapshot.get("radix") or {}).get("companions", ()))
    return tuple((w, tuple(layers)) for w, layers in groups), tables, companions


def _synced_state(e: ev.EngineSynced) -> ViewState:
    state = ViewState(e.step, e.model, e.num_blocks, e.block_size, list(e.ref_counts), list(e.free_queue),
                      prefix_caching=e.prefix_caching, num_cpu_blocks=e.num_cpu_blocks,
                      ranks=[RankView(rank, tuple(heads), size) for rank, heads, size in e.ranks],
                      implementation=dict(e.implementation),
                      cache_hit_tokens=e.cache_hit_tokens, cache_lookup_tokens=e.cache_lookup_tokens)
    queues = {"running": state.running, "waiting": state.waiting, "swapped": state.swapped}
    for fields in e.sequences:
        # 9 fields in traces recorded before the memory mechanisms, 11 since
        rid, status, prompt, n_prompt, text, n_out, n_computed, table, max_tokens = fields[:9]
        cache_node, cpu_table = fields[9:11] if len(fields) >= 11 else (ROOT, ())
        kind = fields[11] if len(fields) >= 12 else ""        # structured output (12 fields since it came)
        state.sequences[rid] = SequenceView(rid, prompt, n_prompt, max_tokens, status, text, n_out, n_computed,
                                          list(table), None, cache_node, list(cpu_table),
                                          GrammarView(kind) if kind else None)
        if status in queues:
            queues[status].append(rid)
    state.kv_groups = [(w, tuple(layers)) for w, layers in e.kv_groups]
    state.companions = {b: list(c) for b, c in e.companions}
    for rid, tables, cpu_tables in e.group_tables:
        state.sequences[rid].group_tables = [list(t) for t in tables]
        state.sequences[rid].cpu_group_tables = [list(t) for t in cpu_tables]
    for node_id, parent_id, text, num_tokens, block_ids, last_access in e.radix:   # parents come first
        state.radix[node_id] = RadixNodeView(node_id, parent_id, text, num_tokens, list(block_ids), last_access)
        state.radix[parent_id].children.append(node_id)
    return state


def _finish(state: ViewState, req: SequenceView, reason: str) -> None:
    if reason not in FINISHED_STATUS:
        raise ValueError(f"unknown finish reason {reason!r} for request {req.seq_id!r}")
    if req.status.startswith("finished"):
        return  # SequenceAborted then SequenceFinished("abort"): count it once
    req.status, req.finish_reason = FINISHED_STATUS[reason], reason
    req.cache_node = ROOT             # a finished request holds no cache node
    req.cpu_block_table = req.cpu_group_tables = []   # nor CPU blocks (an aborted swapped request's are freed)
    for queue in (state.waiting, state.running, state.swapped):
        if req.seq_id in queue:
            queue.remove(req.seq_id)
    state.finished.append(req.seq_id)


def _new_request(state: ViewState, req: SequenceView, queue: list[str]) -> None:
    """A request view joins `queue`. An id can be reused once its request has finished: the new
    request replaces the old one's view (and its place in the finished list)."""
    rid = req.seq_id
    old = state.sequences.pop(rid, None)
    if old is not None and not old.status.startswith("finished"):
        raise ValueError(f"request {rid!r} added while the one with that id is still {old.status}")
    if rid in state.finished:
        state.finished.remove(rid)
    state.sequences[rid] = req
    queue.append(rid)


def _take(state: ViewState, block_id: int) -> None:
    """One more holder; a block with no holder leaves the free queue (wherever it sits)."""
    if state.ref_counts[block_id] == 0 and block_id in state.free_queue:
        state.free_queue.remove(block_id)
    state.ref_counts[block_id] += 1


def _touch_path(state: ViewState, node_id: int, step: int) -> None:
    for n in state.radix_path(node_id):
        state.radix[n].last_access = step


def _matched_nodes(state: ViewState, block_ids: tuple[int, ...]) -> list[int]:
    """The nodes a prefix hit went through: walk down from the root following the hit blocks."""
    path, node, rest = [], state.radix[ROOT], list(block_ids)
    while rest:
        nxt = next((c for c in node.children if state.radix[c].block_ids[:1] == rest[:1]), None)
        if nxt is None:
            break
        path.append(nxt)
        node, rest = state.radix[nxt], rest[len(state.radix[nxt].block_ids):]
    return path


def _fold_radix(state: ViewState, event: ev.Event) -> None:
    """The tree events that are not about one request's table."""
    radix = state.radix
    if isinstance(event, ev.RadixInserted):
        node = RadixNodeView(event.node_id, event.parent_id, event.text, event.num_tokens,
                             list(event.block_ids), event.step)
        radix[event.node_id] = node
        radix[event.parent_id].children.append(event.node_id)
        for block_id in event.block_ids:
            _take(state, block_id)                    # the tree's own reference
        _touch_path(state, event.node_id, event.step)
        state.inserted_nodes.add(event.node_id)
    elif isinstance(event, ev.RadixSplit):
        tail = radix[event.node_id]
        head = RadixNodeView(event.new_node_id, tail.parent_id, event.head_text,
                             event.num_blocks * state.block_size, tail.block_ids[:event.num_blocks],
                             tail.last_access, [tail.node_id])
        siblings = radix[tail.parent_id].children
        siblings[siblings.index(tail.node_id)] = head.node_id   # the head takes the tail's place
        siblings.sort()                                         # children in creation order, like the engine
        radix[head.node_id] = head
        tail.parent_id, tail.text = head.node_id, event.tail_text
        tail.block_ids, tail.num_tokens = tail.block_ids[event.num_blocks:], tail.num_tokens - head.num_tokens
        for marks in (state.hit_nodes, state.inserted_nodes):
            if tail.node_id in marks:
                marks.add(head.node_id)
    elif isinstance(event, ev.RadixEvicted):
        node = radix.pop(event.node_id)
        if node.parent_id in radix:
            radix[node.parent_id].children.remove(node.node_id)
        for block_id in event.block_ids:
            state.ref_counts[block_id] -= 1
        state.free_queue.extend(event.block_ids)
        state.touched_blocks.update(event.block_ids)
        node.last_access = event.last_access
        state.evicted_nodes[node.node_id] = node
        state.hit_nodes.discard(node.node_id)
        state.inserted_nodes.discard(node.node_id)
        forget_evicted(state, event)                  # (KV cache groups: its companions go, BlocksFreed says)


def _fork(state: ViewState, event: ev.Forked) -> None:
    """A new request view: a copy of the parent's, sharing every block of its table."""
    parent = state.sequences.get(event.parent_id)
    if parent is None:
        raise ValueError(f"Forked from unknown request {event.parent_id!r}")
    child = SequenceView(event.seq_id, parent.prompt, parent.num_prompt_tokens, parent.max_tokens,
                        parent.status, parent.output_text, parent.num_output_tokens,
                        parent.num_computed_tokens, list(event.block_ids), None, parent.cache_node)
    if parent.grammar is not None:                    # the fork continues from the parent's place in it
        child.grammar = GrammarView(**{**_fields(parent.grammar), "allowed": list(parent.grammar.allowed)})
    for block_id in event.block_ids:
        _take(state, block_id)                        # shared: one more holder each
    _new_request(state, child, state.waiting if parent.status == "waiting" else state.running)
    state.touched_blocks.update(event.block_ids)


def _fields(view) -> dict:
    return {name: getattr(view, name) for name in view.__slots__}


def _grammar_kind(params: tuple) -> str | None:
    """The structured output's kind from RequestAdded.params ((field, value) pairs), or None."""
    spec = dict(params).get("structured_outputs")
    return spec[0][0] if spec else None


def _fold_constrained(req: SequenceView, event: ev.TokenConstrained) -> None:
    g = req.grammar if req.grammar is not None else GrammarView()   # (a trace that began mid-request)
    req.grammar = g
    g.vocab_size, g.num_allowed = event.vocab_size, event.num_allowed
    g.num_tokens += 1
    g.num_forced += event.forced
    g.num_top_masked += event.top_masked
    g.allowed.append(event.num_allowed)
    del g.allowed[:-HISTORY_LEN]


def _fold_memory(state: ViewState, req: SequenceView, event: ev.Event) -> None:
    """Per-request memory events: prefix hits, locks, dedup, copy-on-write, pruning, swap."""
    rid = req.seq_id
    if isinstance(event, ev.PrefixMatched):
        for block_id in event.block_ids:
            _take(state, block_id)
        req.block_table = list(event.block_ids)       # the table was empty: admission or after preemption
        req.num_computed_tokens = event.num_hit_tokens
        state.cache_hit_tokens += event.num_hit_tokens
        state.cache_lookup_tokens += event.num_tokens
        state.touched_blocks.update(event.block_ids)
        if event.group_block_ids:
            shared_groups(state, req, event.group_block_ids)
        path = _matched_nodes(state, event.block_ids)
        state.hit_nodes.update(path)
        for node_id in path:
            state.radix[node_id].last_access = event.step
    elif isinstance(event, ev.RadixLocked):
        if event.node_id != req.cache_node:           # moved deeper (a hit or an insert): the path is used now;
            _touch_path(state, event.node_id, event.step)   # a fork's child re-locking its parent's node is not a use
        req.cache_node = event.node_id
    elif isinstance(event, ev.BlockDeduplicated):
        _take(state, event.kept)
        req.block_table[event.index] = event.kept
        state.ref_counts[event.dropped] -= 1
        if event.released:
            state.free_queue.append(event.dropped)
        state.touched_blocks.update((event.kept, event.dropped))
    elif isinstance(event, ev.CowCopied):
        req.block_table[event.index] = event.dst
        state.ref_counts[event.src] -= 1
        _take(state, event.dst)
        state.touched_blocks.update((event.src, event.dst))
    elif isinstance(event, ev.BeamPruned):
        _finish(state, req, "pruned")
    elif isinstance(event, ev.SwappedOut):
        for block_id in event.block_ids:
            state.ref_counts[block_id] -= 1
        state.free_queue.extend(event.released)
        req.block_table, req.cpu_block_table = [], list(event.cpu_block_ids)
        state.touched_blocks.update(event.block_ids)
    elif isinstance(event, ev.SwappedIn):
        for block_id in event.block_ids:
            _take(state, block_id)
        req.block_table, req.cpu_block_table = list(event.block_ids), []
        if rid in state.swapped:
            state.swapped.remove(rid)
            state.running.append(rid)
        req.status = "running"
        state.touched_blocks.update(event.block_ids)


def _fold_distributed(state: ViewState, event: ev.Event) -> None:
    """Tensor parallelism's per-step communication and per-rank reports."""
    if isinstance(event, ev.CollectiveOps):
        state.collectives.append((event.kind, event.count, event.num_bytes, event.duration_s))
    elif isinstance(event, ev.RankPoolState):
        while len(state.ranks) <= event.rank:             # a trace recorded without them in EngineSynced
            state.ranks.append(RankView(len(state.ranks), (), 0))
        state.ranks[event.rank] = RankView(event.rank, event.kv_heads, event.bytes_per_block,
                                           event.num_blocks_written, event.num_blocks_copied,
                                           event.num_blocks_swapped, event.digest)


_RADIX_EVENTS = (ev.RadixInserted, ev.RadixSplit, ev.RadixEvicted)
_MEMORY_EVENTS = (ev.PrefixMatched, ev.RadixLocked, ev.BlockDeduplicated, ev.CowCopied, ev.BeamPruned,
                  ev.SwappedOut, ev.SwappedIn)


def fold(state: ViewState | None, event: ev.Event) -> ViewState:
    """Apply one event to `state` (mutated and returned); `EngineSynced` starts afresh.

    Block events mirror `block_pool.py`: allocating unlinks a block from
    wherever it sits in the free queue; freeing drops one holder per block,
    then appends `released` to the tail in the event's order. A holder that
    is not a known request (e.g. the radix tree) changes the pool, no table.
    """
    if isinstance(event, ev.EngineSynced):
        return _synced_state(event)
    if state is None:
        raise ValueError("trace must start with EngineSynced")
    state.step = max(state.step, event.step)
    rid = getattr(event, "seq_id", None)
    req = state.sequences.get(rid)
    if is_group_event(event):              # KV cache groups 1.. (fold_groups.py)
        fold_group_event(state, req, event)
        return state

    if isinstance(event, ev.BlocksAllocated):
        for block_id in event.block_ids:
            _take(state, block_id)                    # a fresh block (head), a revived cached one, or a sharer
        if req is not None:
            req.block_table.extend(event.block_ids)
        state.touched_blocks.update(event.block_ids)
    elif isinstance(event, ev.BlocksFreed):
        for block_id in event.block_ids:
            state.ref_counts[block_id] -= 1
            if req is not None and block_id in req.block_table:
                req.block_table.remove(block_id)
        state.free_queue.extend(event.released)
        state.touched_blocks.update(event.block_ids)
    elif isinstance(event, ev.StepStarted):
        state.step = event.step
        state.touched_blocks.clear()
        state.collectives.clear()
        state.hit_nodes.clear()
        state.inserted_nodes.clear()
        state.evicted_nodes.clear()
        state.left_window.clear()
    elif isinstance(event, ev.StepFinished):
        state.last_step = event
        state.history.append((event.step, event.num_prefill_tokens, event.num_decode_tokens,
                              event.num_free_blocks, event.duration_s))
        del state.history[:-HISTORY_LEN]
        usage = state.kv_usage()
        state.kv_history.append((event.step, usage.used, usage.cached))
        del state.kv_history[:-HISTORY_LEN]
        if state.cache_lookup_tokens:
            state.cache_history.append((event.step, state.cache_hit_tokens, state.cache_lookup_tokens))
            del state.cache_history[:-HISTORY_LEN]
    elif isinstance(event, _RADIX_EVENTS):
        _fold_radix(state, event)
    elif isinstance(event, (ev.CollectiveOps, ev.RankPoolState)):
        _fold_distributed(state, event)
    elif isinstance(event, ev.RequestAdded):
        req = SequenceView(rid, event.prompt, event.num_prompt_tokens, event.max_tokens)
        kind = _grammar_kind(event.params)
        req.grammar = GrammarView(kind) if kind else None
        _new_request(state, req, state.waiting)
    elif isinstance(event, ev.Forked):
        _fork(state, event)
    elif req is None:  # every other event is about a request we must know
        raise ValueError(f"{type(event).__name__} for unknown request {rid!r}")
    elif isinstance(event, _MEMORY_EVENTS):
        _fold_memory(state, req, event)
    elif isinstance(event, ev.SequenceAdmitted):
        state.waiting.remove(rid)
        state.running.append(rid)
        req.status = "running"
    elif isinstance(event, ev.ChunkScheduled):
        req.num_computed_tokens = event.start + event.num_tokens
    elif isinstance(event, ev.Preempted):
        # From running; or from swapped when a failed step never ran its swap-out copy.
        (state.swapped if rid in state.swapped else state.running).remove(rid)
        req.cache_node = ROOT                         # a preempted request lets go of its cache node
        if event.mode == "swap":                      # KV moves to the CPU pool (SwappedOut follows)
            state.swapped.append(rid)
            req.status = "swapped"
        else:                                         # KV dropped: admitted first again, recomputed
            state.waiting.insert(0, rid)
            req.status, req.num_computed_tokens, req.cpu_block_table, req.cpu_group_tables = "waiting", 0, [], []
    elif isinstance(event, ev.KVTransferred):           # its KV came from another engine's pool
        req.num_computed_tokens = event.num_tokens
        state.transfers.append(TransferView(event.step, rid, event.src, event.dst, list(event.src_block_ids),
                                            list(event.block_ids), event.num_tokens, event.num_bytes))
        del state.transfers[:-HISTORY_LEN]
        state.touched_blocks.update(event.block_ids)
    elif isinstance(event, ev.KVTrimmed):
        req.num_computed_tokens = event.num_computed_tokens   # rejected drafts' KV is gone
    elif isinstance(event, ev.TokenConstrained):
        _fold_constrained(req, event)
    elif isinstance(event, ev.TokenSampled):
        req.num_output_tokens += 1
        req.output_text += event.text
    elif isinstance(event, ev.SequenceFinished):
        _finish(state, req, event.finish_reason)
    elif isinstance(event, ev.SequenceAborted):
        _finish(state, req, "abort")
    return state


def fold_all(events) -> ViewState:
    """Fold a whole trace (which must start with EngineSynced) into one view state."""
    state = None
    for event in events:
        state = fold(state, event)
    if state is None:
        raise ValueError("trace must start with EngineSynced")
    return state
