"""Muon for the drafter's weight matrices and AdamW for its other parameters, in one optimizer
(train.optimizer=muon).

Muon (K. Jordan et al., 2024; the scaled form of Liu et al., "Muon is Scalable for LLM Training", arXiv 2502.16982):
a weight matrix's update is its Nesterov momentum made approximately orthogonal by a few Newton-Schulz iterations,
so that every direction of the matrix moves at the same rate instead of the few that dominate the gradient. The
orthogonal update is then scaled to the RMS AdamW's updates have (0.2 * sqrt(max(rows, cols))), so train.lr, the
schedule and weight decay mean the same for both kinds of parameters. Vectors (norms, biases) and anything else
that is not a 2-D matrix keep AdamW.

Like torch's fused AdamW, the optimizer reads `found_inf` (a 0/1 device tensor, set by the Updater when a step's
gradients are not finite): with 1 the step leaves weights and state exactly as they were, without a host sync.
Matrices of one shape are orthogonalised together (one batched matmul per iteration), and the AdamW part uses
torch's multi-tensor (`_foreach`) kernels, so a step costs a few dozen kernel launches, not hundreds.
"""

from __future__ import annotations

from collections import defaultdict

import torch

# The quintic Newton-Schulz iteration's coefficients (Jordan et al.): chosen to push singular values up fast rather
# than to converge exactly, so after 5 steps they sit roughly in [0.7, 1.2] instead of at 1.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
RMS_MATCH = 0.2  # an AdamW update's typical RMS, which the scaled Muon update matches


def is_matrix(p: torch.Tensor) -> bool:
    """Muon's parameters: 2-D with both sides > 1 (a 1 x n "matrix" is a vector, and orthogonalising it only
    normalises it)."""
    return p.dim() == 2 and min(p.shape) > 1


def orthogonalise(g: torch.Tensor, steps: int = NS_STEPS, eps: float = 1e-7) -> torch.Tensor:
    """[..., r, c] -> the same shape: each matrix's singular vectors kept, its singular values pushed towards 1.

    Works on the wide orientation (r <= c), where X @ X^T is the smaller Gram matrix; a tall input is transposed in
    and out. Dividing by the Frobenius norm first puts every singular value in [0, 1], where the iteration works.
    On CUDA the iteration runs in bf16 (tensor cores; its result is approximate by design anyway): in fp32 the
    demo drafter's ~40 matrices would cost ~300 GFLOP of non-tensor-core matmuls a step."""
    a, b, c = NS_COEFFICIENTS
    tall = g.size(-2) > g.size(-1)
    x = g.mT if tall else g
    x = (x / (torch.linalg.matrix_norm(x, keepdim=True) + eps)).to(torch.bfloat16 if g.is_cuda else g.dtype)
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    x = x.to(g.dtype)
    return x.mT if tall else x


class MuonAdamW(torch.optim.Optimizer):
    """One optimizer, two parameter groups: {"muon": True} the matrices (is_matrix), {"muon": False} the rest.

    Per matrix W with gradient G: buf = momentum * buf + G; U = G + momentum * buf (Nesterov);
    W <- W * (1 - lr * weight_decay) - lr * RMS_MATCH * sqrt(max(rows, cols)) * orthogonalise(U).
    The rest: AdamW (decoupled weight decay, bias-corrected moments), the same update torch.optim.AdamW makes."""

    handles_found_inf = True  # read by the Updater: skip non-finite steps on the device through `found_inf`

    def __init__(self, params, lr: float, betas=(0.9, 0.95), weight_decay: float = 0.0, momentum: float = 0.95,
                 eps: float = 1e-8):
        params = list(params)
        groups = [{"params": [p for p in params if is_matrix(p)], "muon": True},
                  {"params": [p for p in params if not is_matrix(p)], "muon": False}]
        defaults = dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay, momentum=momentum, eps=eps)
        super().__init__([g for g in groups if g["params"]], defaults)
        self.found_inf: torch.Tensor | None = None

    @torch.no_grad()
    def step(self, closure=None):
        assert closure is None, "MuonAdamW takes no closure"
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if params:
                (self._muon if group["muon"] else self._adamw)(group, params)

    def _skip(self, params: list[torch.Tensor]):
        """(grads with a skipped step's zeroed, bad: a bool device tensor or None). Zeroed grads plus coefficients
        that keep the old state (a decay of 1, a step size of 0) make a skipped step change nothing."""
        grads = [p.grad for p in params]
        if self.found_inf is None:
            return grads, None
        bad = self.found_inf.to(device=params[0].device).bool()
        return [torch.where(bad, 0.0, g) for g in grads], bad

    def _muon(self, group: dict, params: list[torch.Tensor]) -> None:
        grads, bad = self._skip(params)
        for p in params:
            if "momentum_buffer" not in self.state[p]:
                self.state[p]["momentum_buffer"] = torch.zeros_like(p)
        bufs = [self.state[p]["momentum_buffer"] for p in params]
        m = group["momentum"]
        torch._foreach_mul_(bufs, m if bad is None else torch.where(bad, 1.0, m))
        torch._foreach_add_(bufs, grads)
        updates = torch._foreach_add(grads, bufs, alpha=m)  # Nesterov
        keep = 1.0 if bad is None else (~bad).float()
        if group["weight_decay"]:
            torch._foreach_mul_(params, 1.0 - group["lr"] * group["weight_decay"] * keep)
        by_shape: dict[tuple, list[int]] = defaultdict(list)
        for i, p in enumerate(params):
            by_shape[tuple(p.shape)].append(i)
        for shape, idx in by_shape.items():
            ortho = orthogonalise(torch.stack([updates[i] for i in idx]))
            ortho = ortho * (-group["lr"] * RMS_MATCH * max(shape) ** 0.5 * keep)
            torch._foreach_add_([params[i] for i in idx], list(ortho.unbind(0)))

    def _adamw(self, group: dict, params: list[torch.Tensor]) -> None:
        grads, bad = self._skip(params)
        b1, b2 = group["betas"]
        for p in params:
            if not self.state[p]:
                self.state[p].update(step=torch.zeros((), dtype=torch.float32, device=p.device),
                                     exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
        states = [self.state[p] for p in params]
        steps = [s["step"] for s in states]
        exp_avg, exp_avg_sq = [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states]
        keep = 1.0 if bad is None else (~bad).float()
        torch._foreach_add_(steps, keep)
        torch._foreach_mul_(exp_avg, b1 if bad is None else torch.where(bad, 1.0, b1))
        torch._foreach_add_(exp_avg, grads, alpha=1.0 - b1)
        torch._foreach_mul_(exp_avg_sq, b2 if bad is None else torch.where(bad, 1.0, b2))
        torch._foreach_addcmul_(exp_avg_sq, grads, grads, value=1.0 - b2)
        if group["weight_decay"]:
            torch._foreach_mul_(params, 1.0 - group["lr"] * group["weight_decay"] * keep)
        # All params of the group share their step count: bias corrections from the first one (at least 1, so a
        # skipped first step divides by a nonzero correction; its update is multiplied by 0 anyway).
        t = steps[0].clamp(min=1.0)
        step_size = -group["lr"] * keep / (1.0 - b1 ** t)
        denom = torch._foreach_div(torch._foreach_sqrt(exp_avg_sq), torch.sqrt(1.0 - b2 ** t))
        torch._foreach_add_(denom, group["eps"])
        updates = torch._foreach_div(exp_avg, denom)
        torch._foreach_mul_(updates, step_size)
        torch._foreach_add_(params, updates)
