"""The events of the current step, one per line (wrapped with a hanging indent), coloured by type.

Timings (`duration_s`) are left out on purpose: they differ between runs,
and a replayed step should look exactly like the live one.
"""

from __future__ import annotations

import dataclasses

from rich.segment import Segment
from rich.style import Style
from textual.strip import Strip

from nanoserve import events as ev
from nanoserve.viz.text import plural, token_text
from nanoserve_tui.palette import printable
from nanoserve_tui.widgets.lines import LinesView, wrap

COLOURS = {
    "EngineSynced": "bold white", "StepStarted": "bold #56b6c2", "StepFinished": "bold #56b6c2",
    "RequestAdded": "#e5c07b", "SequenceAdmitted": "#98c379", "ChunkScheduled": "#82aaff",
    "BlocksAllocated": "#98c379", "BlocksFreed": "#d19a66", "Preempted": "bold #e06c75",
    "TokenSampled": "#9a9a9a", "SequenceFinished": "#c678dd", "SequenceAborted": "bold #e06c75",
    "DraftProposed": "#7fdbca", "DraftVerified": "#56b6c2", "KVTrimmed": "#d19a66",
    "PrefixMatched": "bold #e5c07b", "RadixInserted": "#98c379", "RadixSplit": "#82aaff", "RadixLocked": "#9a9a9a",
    "RadixEvicted": "#e06c75", "BlockDeduplicated": "#7fdbca", "Forked": "bold #c678dd", "CowCopied": "#c678dd",
    "BeamPruned": "#d19a66", "SwappedOut": "bold #e06c75", "SwappedIn": "bold #98c379",
    "CollectiveOps": "#82aaff", "RankPoolState": "#9a9a9a", "KVTransferred": "bold #7fdbca",
    "TokenConstrained": "#e5c07b", "BlocksLeftWindow": "#d19a66", "GroupsCached": "#98c379",
    "CompanionEvicted": "#e06c75", "GroupsForked": "#c678dd",
}
STYLES = {name: Style.parse(colour) for name, colour in COLOURS.items()}
NAME_WIDTH = 16
MAX_EVENTS = 400   # a 256-request step has ~500 events; the rest is summarised in one line


def _ids(ids) -> str:
    return "[" + " ".join(map(str, ids)) + "]"


def describe(e: ev.Event, ends: bool = False) -> str:
    """One line of detail for an event (everything but its type and timings); `ends`: this TokenSampled is
    the last token of a sequence the step stopped ("stop"), so a token without text is its EOS."""
    match e:
        case ev.EngineSynced():
            return f"{e.model}: {e.num_blocks} blocks × {e.block_size} tokens, {len(e.sequences)} requests"
        case ev.StepStarted():
            return f"step {e.step}: {e.num_waiting} waiting, {e.num_running} running"
        case ev.StepFinished():
            return (f"{plural(e.num_seqs, 'sequence')}, {e.num_prefill_tokens} prefill + {e.num_decode_tokens} "
                    f"decode tokens, {plural(e.num_free_blocks, 'block')} free")
        case ev.RequestAdded():
            return (f"{e.seq_id}: {plural(e.num_prompt_tokens, 'prompt token')}, max {e.max_tokens} "
                    f"{printable(e.prompt)[:40]!r}")
        case ev.ChunkScheduled():
            kind = "prefill" if e.is_prefill else "decode"
            return f"{e.seq_id} {kind} tokens {e.start}-{e.start + e.num_tokens - 1}"
        case ev.BlocksAllocated():
            return f"{e.seq_id} +{_ids(e.block_ids)}" + (f" in group {e.group}" if e.group else "")
        case ev.BlocksFreed():
            return (f"{e.seq_id} -{_ids(e.block_ids)}" + (f" in group {e.group}" if e.group else "")
                    + f", to the free queue {_ids(e.released)}")
        case ev.Preempted():
            if e.mode == "swap":
                return f"{e.seq_id} (swap): its KV moves to the CPU pool"
            return f"{e.seq_id} ({e.mode}): {e.num_tokens_lost} tokens of KV to compute again"
        case ev.TokenSampled():
            return f"{e.seq_id} token {e.token_id} {token_text(e.text, ends)} logprob {e.logprob:.2f}"
        case ev.TokenConstrained():
            if e.forced:
                return f"{e.seq_id} grammar allowed only token {e.token_id}: forced, the model had no say"
            return (f"{e.seq_id} grammar allowed {e.num_allowed}/{e.vocab_size} tokens"
                    + (", masked the model's top choice" if e.top_masked else "") + f"; drew {e.token_id}")
        case ev.SequenceFinished():
            return f"{e.seq_id} {e.finish_reason} after {e.num_output_tokens} tokens" + (
                f": {printable(e.error)}" if e.error else "")
        case ev.DraftProposed():
            return f"{e.seq_id} {e.method} guesses {_ids(e.token_ids)}"
        case ev.DraftVerified():
            extra = "bonus" if e.is_bonus else "corrected"
            return f"{e.seq_id} accepted {e.num_accepted}/{e.num_drafted}, {extra} token {e.token_id}"
        case ev.KVTrimmed():
            return (f"{e.seq_id} dropped KV of {e.num_tokens_dropped} rejected tokens, keeps "
                    f"{e.num_computed_tokens}, gives back {_ids(e.block_ids)}")
        case ev.PrefixMatched():
            if not e.num_hit_tokens:
                return f"{e.seq_id} miss: none of its {e.num_tokens} tokens cached"
            return (f"{e.seq_id} hit {e.num_hit_tokens}/{e.num_tokens} tokens, reuses {_ids(e.block_ids)}: "
                    f"their prefill is skipped")
        case ev.RadixInserted():
            return (f"node {e.node_id} under {e.parent_id}: {printable(e.text)[:30]!r} {_ids(e.block_ids)} "
                    f"from {e.seq_id}")
        case ev.RadixSplit():
            return (f"node {e.node_id} cut after {e.num_blocks} blocks: head {e.new_node_id} "
                    f"{printable(e.head_text)[:20]!r}, tail {printable(e.tail_text)[:20]!r}")
        case ev.RadixLocked():
            return f"{e.seq_id} holds node {e.node_id}" if e.node_id else f"{e.seq_id} holds no node"
        case ev.RadixEvicted():
            return f"node {e.node_id} (last used step {e.last_access}) -> free queue {_ids(e.block_ids)}"
        case ev.BlockDeduplicated():
            return (f"{e.seq_id} logical {e.index}: block {e.dropped} equals cached {e.kept}, uses it"
                    + (f"; {e.dropped} freed" if e.released else ""))
        case ev.Forked():
            return f"{e.parent_id} -> {e.seq_id}, sharing {_ids(e.block_ids)}"
        case ev.CowCopied():
            return f"{e.seq_id} logical {e.index}: shared block {e.src} copied to {e.dst} before writing"
        case ev.BeamPruned():
            return f"{e.seq_id} dropped: no best candidate continues it"
        case ev.SwappedOut():
            return (f"{e.seq_id} {_ids(e.block_ids)} -> CPU {_ids(e.cpu_block_ids)}, "
                    f"to the free queue {_ids(e.released)}")
        case ev.SwappedIn():
            return f"{e.seq_id} CPU {_ids(e.cpu_block_ids)} -> {_ids(e.block_ids)}"
        case ev.CollectiveOps():
            return f"{e.kind} ×{e.count}, {e.num_bytes} bytes from rank 0"
        case ev.RankPoolState():
            return (f"rank {e.rank} (KV heads {_ids(e.kv_heads)}): wrote {e.num_blocks_written} blocks, "
                    f"copied {e.num_blocks_copied}, swapped {e.num_blocks_swapped}, slots {e.digest}")
        case ev.BlocksLeftWindow():
            return (f"{e.seq_id} group {e.group}: window {e.window} passed logical {_ids(e.indices)}, gives back "
                    f"{_ids(e.block_ids)}, to the free queue {_ids(e.released)}")
        case ev.GroupsCached():
            return f"cache keeps, with {_ids(e.block_ids)}, the other groups' {_ids(sum(e.group_block_ids, ()))}"
        case ev.CompanionEvicted():
            return (f"cache lets go of block {e.companion} (group {e.group}, with {e.block_id})"
                    + (", to the free queue" if e.released else ""))
        case ev.GroupsForked():
            return f"{e.parent_id} -> {e.seq_id}, groups 1.. sharing {_ids(sum(e.group_block_ids, ()))}"
        case ev.KVTransferred():
            return (f"{e.seq_id} {e.src} {_ids(e.src_block_ids)} -> {e.dst} {_ids(e.block_ids)}: "
                    f"KV of {e.num_tokens} tokens, {e.num_bytes} bytes")
    fields = [f for f in dataclasses.fields(e) if f.name not in ("step", "duration_s")]
    return " ".join(str(getattr(e, f.name)) for f in fields)


def event_lines(events, width: int) -> list[Strip]:
    """Each event: its type (coloured), then its details wrapped under the details column."""
    lines: list[Strip] = []
    stopped = {e.seq_id for e in events if isinstance(e, ev.SequenceFinished) and e.finish_reason == "stop"}
    last = {e.seq_id: i for i, e in enumerate(events) if isinstance(e, ev.TokenSampled) and e.seq_id in stopped}
    for i, e in enumerate(events[:MAX_EVENTS]):
        name = type(e).__name__
        first = [Segment(f"{name:<{NAME_WIDTH - 1}} ", STYLES.get(name))]
        words = describe(e, last.get(getattr(e, "seq_id", None)) == i).split(" ")
        pieces = [([Segment(w if i == 0 else " " + w)], len(w) + (i > 0)) for i, w in enumerate(words)]
        lines += wrap(pieces, max(width, NAME_WIDTH + 10), first, NAME_WIDTH)
    if len(events) > MAX_EVENTS:
        lines.append(Strip([Segment(f"… {len(events) - MAX_EVENTS} more events this step", Style(dim=True))]))
    return lines


class EventLog(LinesView):
    """Shows one step's events, from the top."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.events: tuple = ()

    def show_events(self, events) -> None:
        self.events = tuple(events)
        self.show_lines(event_lines(self.events, self.scrollable_content_region.width))
        self.scroll_home(animate=False, immediate=True)

    def on_resize(self) -> None:
        self.show_lines(event_lines(self.events, self.scrollable_content_region.width))
