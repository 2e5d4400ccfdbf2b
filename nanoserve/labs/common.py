"""Checks every lab shares: the student's signatures match the engine's."""

from __future__ import annotations

from nanoserve.labs.lab import Check, CheckFailed, Context
from nanoserve.labs.starter import signature_mismatches


def _signatures(ctx: Context) -> None:
    bad = signature_mismatches(ctx.lab, ctx.module)
    if bad:
        raise CheckFailed("; ".join(bad))


SIGNATURES = Check("signatures match the engine's", _signatures,
                   "keep the names and arguments of the starter: the engine calls them exactly so", 30)
