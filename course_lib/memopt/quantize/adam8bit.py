"""8-bit Adam: AdamW whose m and v are KEPT between steps as block-wise quantized bytes (Dettmers, Lewis, Shleifer
& Zettlemoyer, "8-bit Optimizers via Block-wise Quantization", ICLR 2022, arXiv 2110.02861, §2).

The update itself is `adamw_` on fp32 temporaries; only the storage is 8-bit. m uses the signed dynamic map, v the
unsigned one (course_lib.memopt.quantize.blockwise). State bytes (formulas §7.4): 8Ψ → 2Ψ + 8·Σ⌈n/B⌉.
"""
from __future__ import annotations

import torch

from ...optim.adamw import adamw_
from .blockwise import PAPER_BLOCK_SIZE, QTensor, _decode, _encode, _map, block_lengths, dequantize_blockwise


class Adam8bit(torch.optim.Optimizer):
    """AdamW with 8-bit block-wise state (Dettmers et al. 2022). Each step:

        m, v = dequantize(state)                  fp32 temporaries
        adamw_(p, g, m, v, t)                     the course's one AdamW step (course_lib.optim.adamw)
        state = quantize(m: signed dynamic map, v: unsigned dynamic map), blocks of `block_size` per tensor

    State per tensor of n elements: two uint8 code tensors (n bytes each) and two fp32 absmax tensors (⌈n/B⌉ each);
    the step count is a Python int. Blocks never straddle two tensors, but the arithmetic runs on all the tensors
    of a step at once (laid end to end, with per-tensor block lengths), so the per-step cost does not grow with the
    number of tensors. Every tensor is quantized, however small (bitsandbytes keeps tensors under
    `min_8bit_size` = 4096 elements in fp32 by default).
    """

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 block_size: int = PAPER_BLOCK_SIZE):
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.block_size = block_size

    def _init_state(self, p: torch.Tensor) -> dict:
        st = self.state[p]
        if not st:                                            # zeros, quantized: the code of 0, absmax 0
            nb = len(block_lengths(p.numel(), self.block_size))
            st["step"] = 0
            for name, kind in (("exp_avg", "dynamic"), ("exp_avg_sq", "dynamic_unsigned")):
                st[f"{name}_codes"] = torch.full((p.numel(),), int((_map(kind) == 0).nonzero()[0]), dtype=torch.uint8)
                st[f"{name}_absmax"] = torch.zeros(nb)
        return st

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            for p in params:
                self._init_state(p)["step"] += 1
            for t in sorted({self.state[p]["step"] for p in params}):   # one batch per step count (normally one)
                self._update([p for p in params if self.state[p]["step"] == t], t, group)
        return None

    def _update(self, params: list, t: int, group: dict) -> None:
        (beta1, beta2) = group["betas"]
        sts = [self.state[p] for p in params]
        lengths = torch.tensor([b for p in params for b in block_lengths(p.numel(), self.block_size)])
        m = _decode(torch.cat([st["exp_avg_codes"] for st in sts]), torch.cat([st["exp_avg_absmax"] for st in sts]),
                    lengths, "dynamic")                                        # (Ψ,) fp32
        v = _decode(torch.cat([st["exp_avg_sq_codes"] for st in sts]),
                    torch.cat([st["exp_avg_sq_absmax"] for st in sts]), lengths, "dynamic_unsigned")
        g = torch.cat([p.grad.reshape(-1).float() for p in params])
        p32 = torch.cat([p.detach().reshape(-1).float() for p in params])
        adamw_(p32, g, m, v, t, lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
               weight_decay=group["weight_decay"])
        numels = [p.numel() for p in params]
        blocks = [len(block_lengths(n, self.block_size)) for n in numels]
        for p, new in zip(params, p32.split(numels)):
            p.copy_(new.view_as(p))
        for name, kind, value in (("exp_avg", "dynamic", m), ("exp_avg_sq", "dynamic_unsigned", v)):
            codes, absmax = _encode(value, lengths, kind)                      # in place: the state keeps its storage
            for st, c, a in zip(sts, codes.split(numels), absmax.split(blocks)):
                st[f"{name}_codes"].copy_(c)
                st[f"{name}_absmax"].copy_(a)

    def dequantized_state(self, p: torch.Tensor) -> dict:
        """{'exp_avg': m, 'exp_avg_sq': v} of parameter p, in fp32."""
        st = self.state[p]
        return {name: dequantize_blockwise(QTensor(st[f"{name}_codes"], st[f"{name}_absmax"], p.shape, kind,
                                                   self.block_size))
                for name, kind in (("exp_avg", "dynamic"), ("exp_avg_sq", "dynamic_unsigned"))}


def adam8bit_state_bytes(numels, block_size: int = PAPER_BLOCK_SIZE) -> int:
    """2 bytes per element + 2 fp32 absmax per block of every tensor: 2Ψ + 8·Σ⌈n/B⌉ (vs fp32 Adam's 8Ψ)."""
    return sum(2 * n + 8 * -(-n // block_size) for n in numels)


__all__ = ["Adam8bit", "adam8bit_state_bytes"]
