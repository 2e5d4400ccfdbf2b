"""Bug: on rejection the residual is max(0, p - q * p(x)/q(x)) instead of max(0, p - q)."""
import torch

EXPECT_HINT = "max(0, p - q·p(x)/q(x))"


def verify(p, draft, q, greedy, generator):
    p = p.cpu()
    q = q.cpu() if q is not None else None
    for i, x in enumerate(draft):
        if greedy:
            if x == int(p[i].argmax()):
                continue
            return draft[:i] + [int(p[i].argmax())], i
        q_x = float(q[i, x]) if q is not None else 1.0
        u = float(torch.rand((), generator=generator))
        if u * q_x < float(p[i, x]):
            continue
        if q is not None:
            residual = (p[i] - q[i] * p[i, x] / q[i, x]).clamp_min(0.0)
        else:
            residual = p[i].clone()
            residual[x] = 0.0
        token = int(torch.multinomial(residual / residual.sum(), 1, generator=generator))
        return draft[:i] + [token], i
    n = len(draft)
    bonus = int(p[n].argmax()) if greedy else int(torch.multinomial(p[n], 1, generator=generator))
    return draft + [bonus], n
