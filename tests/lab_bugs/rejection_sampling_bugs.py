"""Known bugs of the rejection-sampling lab (nanoserve/spec_decode.py's verify), and its equivalent mutants.
See make.py."""

from make import Bug

BUGS = (
    Bug("greedy_keeps_wrong", "verify", "greedy keeps the first draft token that is not the argmax and stops after "
        "it", (("            return draft[:i] + [int(p[i].argmax())], i", "            return draft[:i + 1], i"),),
        "then emit the argmax"),
    Bug("no_bonus", "verify", "when every draft token is accepted, no bonus token is emitted",
        (("    return draft + [bonus], n", "    return draft, n"),), "bonus"),
    Bug("inverted_ratio", "verify", "accepts with probability min(1, q(x)/p(x)), the ratio upside down",
        (("if u * q_x < float(p[i, x]):", "if u * float(p[i, x]) < q_x:"),), "min(1, p(x)/q(x))"),
    Bug("residual_is_p", "verify", "after rejecting an n-gram token x it draws from p itself, which can give x "
        "again", (("            residual[x] = 0.0\n", ""),), "p with x removed"),
    Bug("scaled_residual", "verify", "on rejection it draws from max(0, p - q·p(x)/q(x)), not max(0, p - q)",
        (("residual = (p[i] - q[i]).clamp_min(0.0)", "residual = (p[i] - q[i] * p[i, x] / q[i, x]).clamp_min(0.0)"),),
        "normalise(max(0, p - q))"),
    Bug("bonus_argmax", "verify", "a sampled request's bonus token is p[k]'s argmax instead of a draw from p[k]",
        (("bonus = int(p[n].argmax()) if greedy else int(torch.multinomial(p[n], 1, generator=generator))",
          "bonus = int(p[n].argmax())"),), "bonus"),
    Bug("global_rng", "verify", "the acceptance draw comes from the global RNG, not the request's generator",
        (("u = float(torch.rand((), generator=generator))", "u = float(torch.rand(()))"),), "generator"),
    Bug("miscounts_accepted", "verify", "on a rejection it reports one more accepted draft than it kept",
        (("        return draft[:i] + [token], i\n", "        return draft[:i] + [token], i + 1\n"),), "accepted"),
)

EQUIVALENT = {
    'verify:drop: p = p.cpu() :: p = p.cpu() -> pass':
        "the lab's channel hands verify CPU tensors (wire.py copies a tensor to the CPU): .cpu() returns the same tensor",
    'verify:drop: q = q.cpu() if q is not None else None :: q = q.cpu() if q is not None else None -> pass':
        'the same for q: a CPU tensor, or None',
    'verify:compare: if u * q_x < float(p[i, x]):          # u < p(x) / q(x): accept with probability min(1, p/q) :: u * q_x < float(p[i, x]) -> u * q_x <= float(p[i, x])':
        'differs only when u * q(x) == p(x) exactly; u is a float32 uniform, so for p(x) > 0 this is a single float value of u (probability about 2^-24 per draw, the same as the rounding of u itself) and for p(x) = 0 it needs u == 0 (2^-24): no distribution check can see it',
}
