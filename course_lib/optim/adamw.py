"""AdamW, written once: one step on one tensor (`adamw_`) and the optimizer that applies it to every parameter.

Every optimizer the course builds from scratch — ZeRO-Offload's CPU Adam and the SSD tier's (notebook 07), 8-bit
Adam and the mixed-precision master-weight optimizer (notebook 09), and the plain `AdamW` below — updates a tensor
with `adamw_`, so a change of recipe (where the state lives, in what precision) never changes the update rule, and
each can be checked bit for bit against `torch.optim.AdamW` (single-tensor path, foreach=False) on the same numbers.

Loshchilov & Hutter, "Decoupled Weight Decay Regularization", ICLR 2019 (docs/formulas.md §1).
"""
from __future__ import annotations

import torch


def adamw_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, step: int, *,
           lr: float, beta1: float, beta2: float, eps: float, weight_decay: float) -> None:
    """One AdamW step on one tensor, in place (Loshchilov & Hutter, ICLR 2019), in the order of operations of
    torch.optim.AdamW's single-tensor path — so the CPU step can be checked bit for bit against torch's:

        θ ← θ·(1 − lr·λ);  m ← m + (1 − β₁)(g − m);  v ← β₂·v + (1 − β₂)·g²
        θ ← θ − lr/(1 − β₁ᵗ) · m / (√v / √(1 − β₂ᵗ) + ε)
    """
    if weight_decay != 0:
        param.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    bias_correction1 = 1 - beta1 ** step
    bias_correction2 = 1 - beta2 ** step
    step_size = lr / bias_correction1
    denom = (exp_avg_sq.sqrt() / bias_correction2 ** 0.5).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)


class AdamW(torch.optim.Optimizer):
    """AdamW from scratch: `adamw_` on every parameter that has a gradient, one tensor at a time.

    The state is torch's, under torch's names — `step` (a 0-d fp32 tensor: 4 bytes per parameter tensor, what the
    memory accountant counts), `exp_avg`, `exp_avg_sq` (the parameter's dtype and shape) — so its bytes, its
    state_dict and its numbers equal `torch.optim.AdamW(foreach=False)`'s (tests/unit/test_optim.py: bit for bit,
    float32 and float64, with weight decay).
    """

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 1e-2):
        if not lr > 0 or not eps >= 0 or not weight_decay >= 0:
            raise ValueError(f"AdamW needs lr > 0, eps >= 0 and weight_decay >= 0; got lr={lr!r}, eps={eps!r}, "
                             f"weight_decay={weight_decay!r}")
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"AdamW's betas must lie in [0, 1), got {betas!r}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["step"] = torch.tensor(0.0)
                    st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                st["step"] += 1
                adamw_(p, p.grad, st["exp_avg"], st["exp_avg_sq"], st["step"].item(), lr=group["lr"], beta1=beta1,
                       beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"])
        return loss


__all__ = ["adamw_", "AdamW"]
