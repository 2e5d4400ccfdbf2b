"""Checks every lab shares: the student's signatures match the engine's."""

from __future__ import annotations

from nanoserve.labs.lab import Check, CheckFailed, Context


def _signatures(ctx: Context) -> None:
    bad = ctx.helper("nanoserve.labs.starter:signature_mismatches_of", ctx.lab.module, list(ctx.lab.blanks),
                     ctx.module)
    if not isinstance(bad, list) or not all(isinstance(line, str) for line in bad):
        raise CheckFailed("the signature check got no list of names back")
    if bad:
        raise CheckFailed("; ".join(bad))


SIGNATURES = Check("signatures match the engine's", _signatures,
                   "keep the names and arguments of the starter: the engine calls them exactly so", 30)
