"""How model text is shown, the same way in every viewer (TUI, REPL, Graphviz).

Generated text holds newlines, tabs, control bytes (random tiny models emit
any byte), pieces of characters (a character is several bytes, and a token,
or a block of tokens, may end in the middle of one) and tokens that add no
text at all (special tokens such as `<|im_end|>`, or the first bytes of a
character still being spelled). A viewer draws one cell per character and
must not be broken by any of them, nor make them look like an encoding bug:

    >>> shown("Hi\\n\\tthere\\x07")
    'Hi⏎→there·'
    >>> shown("llo.O\\t\\ufffd\\ufffd")
    'llo.O→⟨bytes⟩'
    >>> token_text("")
    '⟨no text⟩'

* a newline is `⏎` and a tab `→`, so the line structure stays visible;
* bytes that are not a whole character (the decoder's U+FFFD, one per stray
  byte) are one `⟨bytes⟩` per run, a visible marker rather than `�`;
* any other control, combining or double-width character is `·`;
* a token that added no text is `⟨no text⟩` (it was still generated: see its id),
  or `⟨end of sequence⟩` when it stopped its sequence (an EOS or stop token).
"""

from __future__ import annotations

import codecs
import unicodedata

NEWLINE, TAB, OTHER = "⏎", "→", "·"
FRAGMENT = "⟨bytes⟩"        # a run of bytes that spell no whole character (U+FFFD from the decoder)
NO_TEXT = "⟨no text⟩"
END = "⟨end of sequence⟩"   # a token with no text that stopped its sequence: EOS or a stop token


def shown(text: str) -> str:
    """`text` with one printable, single-width character per character (see the module docstring)."""
    out = []
    for c in text:
        if c == "\ufffd":
            if not out or out[-1] != FRAGMENT:
                out.append(FRAGMENT)
        elif c == "\n":
            out.append(NEWLINE)
        elif c == "\t":
            out.append(TAB)
        elif c.isprintable() and not unicodedata.combining(c) and unicodedata.east_asian_width(c) not in "WF":
            out.append(c)
        else:
            out.append(OTHER)
    return "".join(out)


def escaped(text: str) -> str:
    """`text` safe to print on a terminal: newlines and tabs kept, any other control character as an escape.

        >>> escaped("Hi\\x1b[2J\\tthere\\n")
        'Hi\\\\x1b[2J\\tthere\\n'
    """
    return "".join(c if c in "\n\t" or not unicodedata.category(c).startswith("C") else repr(c)[1:-1] for c in text)


def byte_text(token_ids, final: bool = True) -> str:
    """A byte-level model's output (tiny-gpt2, tiny-llama: token id = byte value) as printable text: its bytes
    decoded as UTF-8, every byte that is not part of a character and every control byte escaped (`\\x8f`).
    Ids past 255 (its end-of-text token) add nothing. `final=False` (a stream) holds back the bytes that may
    still become a character, so the text only ever grows."""
    decoder = codecs.getincrementaldecoder("utf-8")("backslashreplace")
    return escaped(decoder.decode(bytes(i for i in token_ids if i < 256), final=final))


def token_text(text: str, ends: bool = False) -> str:
    """What one sampled token added, for an event line: quoted; ⟨end of sequence⟩ for a token that added no
    text and ended its sequence (EOS, such as SmolLM2's `<|im_end|>`, or a stop token); else ⟨no text⟩."""
    return repr(shown(text)) if text else END if ends else NO_TEXT


def plural(count: int, unit: str) -> str:
    """`1 token`, `2 tokens`: counts that read as counts."""
    return f"{count} {unit}{'' if count == 1 else 's'}"
