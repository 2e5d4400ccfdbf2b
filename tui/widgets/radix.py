"""The radix tree of the prefix cache, as a Textual `Tree`.

The engine has no prefix cache yet, so the tree is only its root and a note.
The widget stays so the tree fills in when `radix_cache.py` lands and its
events reach `fold()`.
"""

from __future__ import annotations

from textual.widgets import Tree

NOT_YET = "prefix caching: not in this engine yet"


class RadixTree(Tree[None]):
    def __init__(self, **kwargs) -> None:
        super().__init__("root", **kwargs)
        self.show_root = True
        self.root.expand()
        self.root.add_leaf(NOT_YET)
