"""Incremental detokenization and stop strings: from token ids to streamable text.

Text cannot be produced one token at a time by decoding each token alone:
byte-level BPE splits a multi-byte character across tokens, and
SentencePiece decides spaces from the neighbouring tokens. So each update
decodes a small window: the tokens since `prefix_offset` with and without
the new ones (vLLM's incremental detokenization), and the difference is the
new text. A window whose text ends in U+FFFD (an incomplete UTF-8 character)
waits for the next token. Decoding a window instead of the whole output keeps
each step's cost constant however long the output grows.

The last `len(longest stop string) - 1` characters are held back too: they
might be the start of a stop string, and the text a user sees never contains
a stop string, not even half of one for a step.

When a stop string appears, the text is cut just before it (just after it with
`include_stop_str_in_output`) and the sequence stops. Before `min_tokens` tokens nothing stops a request (vLLM's rule too):
a stop string that is complete before then is ordinary text, and only a
match that ends in text from token `min_tokens` on counts. The engine owns
the other stop conditions (EOS, stop ids, max_tokens).
"""

from __future__ import annotations

import copy

from nanoserve.sampling_params import SamplingParams


class IncrementalDetokenizer:
    def __init__(self, tokenizer, params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.stop = params.stop
        self.include_stop = params.include_stop_str_in_output   # keep the stop string itself in the text
        self.skip_special_tokens = params.skip_special_tokens
        self.hold = max((len(s) for s in self.stop), default=1) - 1   # chars that may start a stop string
        self.text = ""       # everything decoded so far (cut at a stop string)
        self.released = 0    # how much of `text` has been handed out
        self.prefix_offset = 0   # the decode window starts at this token ...
        self.read_offset = 0     # ... and the tokens before this one are already in `text`
        self.stop_floor = 0      # a stop string must end after this many characters (text before min_tokens)

    def fork(self) -> IncrementalDetokenizer:
        """A copy at the same point, for a forked sequence (its text goes on from here on its own)."""
        return copy.copy(self)   # plain state: a shallow copy

    def _new_text(self, ids: list[int]) -> str:
        """Text added by the tokens from read_offset on ("" while a character is incomplete)."""
        decode = lambda t: self.tokenizer.decode(t, skip_special_tokens=self.skip_special_tokens)  # noqa: E731
        prefix = decode(ids[self.prefix_offset : self.read_offset])
        window = decode(ids[self.prefix_offset :])
        if len(window) <= len(prefix) or window.endswith("\ufffd"):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(ids)
        return window[len(prefix) :]

    def update(self, output_token_ids: list[int], check_stop: bool = True) -> tuple[str, bool]:
        """Decode after new tokens; return (newly releasable text, hit a stop string)."""
        if self.tokenizer is None:
            return "", False
        text = self.text + self._new_text(output_token_ids)
        stopped = False
        if not check_stop:
            self.stop_floor = len(text)   # nothing in here may stop the request, even later
        elif self.stop:
            # Only the tail can hold a new stop string: start a little before the old end
            # (a few characters more, in case the last character was incomplete before),
            # and never where the match would end inside the text before min_tokens.
            search_from = max(0, len(self.text) - self.hold - 4)
            hits = [(i, s) for s in self.stop if (i := text.find(s, max(search_from, self.stop_floor - len(s) + 1))) >= 0]
            if hits:   # the earliest stop string (the first listed, on a tie) ends the text
                i, s = min(hits, key=lambda hit: hit[0])
                text, stopped = text[: i + len(s) if self.include_stop else i], True
        self.text = text
        if stopped:
            return self.flush(), True
        return self._release(len(text) - self.hold), False

    def flush(self) -> str:
        """The request is over: release everything that is left."""
        return self._release(len(self.text))

    def _release(self, end: int) -> str:
        if end <= self.released:
            return ""
        delta, self.released = self.text[self.released : end], end
        return delta
