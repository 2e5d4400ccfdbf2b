"""Known bugs of the triton-decode lab (nanoserve/kernels/triton_common.py), and its equivalent mutants.
See make.py."""

from make import Bug

BUGS = (
    Bug("no_rescale", "online_softmax_step", "the old sum and output are never rescaled by alpha: right for one "
        "tile, wrong for several", (("l_i = l_i * alpha + tl.sum(p, axis=1)", "l_i = l_i + tl.sum(p, axis=1)"),
                                    ("acc = acc * alpha[:, None] + ", "acc = acc + ")), "l ="),
    Bug("rescale_only_l", "online_softmax_step", "the sum is rescaled by alpha but the output is not",
        (("acc = acc * alpha[:, None] + ", "acc = acc + "),), "acc"),
    Bug("unsafe_max", "online_softmax_step", "the exponents use the new max directly: a fully masked row computes "
        "exp(-inf - -inf) = NaN", (('m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)', "m_safe = m_new"),),
        "NaN"),
    Bug("forgets_old_max", "online_softmax_step", "the new max is the tile's alone, not the larger of it and the "
        "running max", (("m_new = tl.maximum(m_i, tl.max(s, axis=1))", "m_new = tl.max(s, axis=1)"),), "m_new"),
)

EQUIVALENT = {
}
