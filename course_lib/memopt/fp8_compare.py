"""Our FP8 linear against torchao's, layer by layer, with a bound that holds for any seed and any CPU (notebook 09).

End to end, two FP8 models cannot be compared tightly: they sum in different orders, and a 10⁻⁷ difference that lands
near a rounding boundary of the fp8 grid moves a value by a whole fp8 step (2⁻³ relative for E4M3), which then
travels through every later layer. How often that happens depends on the seed and the CPU's summation order. So the
comparison is made where it is exact: each linear gets the SAME input and the SAME output gradient (captured from an
fp32 run), in ours and in torchao's `Float8Linear` (dynamic tensorwise scaling: `Fp8Scaling(delayed=False)`).

Both then cast the same tensors with the same scale, fp8_max / amax rounded to fp32, so their fp8 values are equal,
and what remains is fp32 arithmetic on equal inputs. For C = A·B with an inner dimension K, each side computes every
element within γ_{K+4}·(|A|·|B|) of the exact product of the dequantized inputs (Higham, *Accuracy and Stability of
Numerical Algorithms*, §3.5: any order of summation, FMA or not; +4 for the dequantizing multiply or divide of each
input, and torchao's reciprocal of the scale), where γ_n = n·u/(1 − n·u), u = 2⁻²⁴. So, element by element,

    |ours − torchao| ≤ 2·γ_{K+4} · (|A|·|B|)         for y = x·Wᵀ (K = in), ∂x = ∂y·W (K = out), ∂W = ∂yᵀ·x (K = tokens)

A cast that differed (one fp8 step on one element) would break this bound by orders of magnitude in that row.
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from .precision import Fp8Linear

U32 = 2.0 ** -24                   # unit roundoff of fp32


def gamma(n: int) -> float:
    """γ_n = n·u/(1 − n·u) for fp32 (Higham §3.1)."""
    return n * U32 / (1 - n * U32)


def linear_inputs(model: nn.Module, x, y, *, filter=lambda name: "blocks." in name) -> dict:
    """{name: (input, gradient of the loss w.r.t. the output)} of every nn.Linear whose name passes `filter`, from
    one forward and backward of `model` (fp32) on tokens x, targets y."""
    seen, hooks = {}, []

    def capture(name):
        def hook(mod, args, out):
            seen[name] = [args[0].detach()]
            out.register_hook(lambda g: seen[name].append(g.detach()))
        return hook
    for name, mod in model.named_modules():
        if type(mod) is nn.Linear and filter(name):
            hooks.append(mod.register_forward_hook(capture(name)))
    try:
        model(x, y)[1].backward()
    finally:
        for h in hooks:
            h.remove()
    return {name: tuple(v) for name, v in seen.items()}


def _torchao_linear(weight: torch.Tensor) -> nn.Module:
    for noisy in ("torchao", "torch.utils._pytree"):   # start-up notes of the reference library, not our concern
        logging.getLogger(noisy).setLevel(logging.ERROR)
    from torchao.float8 import convert_to_float8_training
    lin = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    lin.weight = nn.Parameter(weight.detach().clone())
    return convert_to_float8_training(nn.Sequential(lin))


def _ours_linear(weight: torch.Tensor) -> nn.Module:
    lin = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    lin.weight = nn.Parameter(weight.detach().clone())
    return Fp8Linear.from_linear(lin, delayed=False)


def _run(mod: nn.Module, x: torch.Tensor, gy: torch.Tensor) -> tuple:
    x = x.clone().requires_grad_()
    y = mod(x)
    y.backward(gy)
    weight = next(mod.parameters())
    return y.detach(), x.grad, weight.grad


def compare_linear(weight: torch.Tensor, x: torch.Tensor, gy: torch.Tensor) -> dict:
    """Ours and torchao's FP8 linear (no bias) on the same x and ∂y: for y, ∂x and ∂W, the largest
    |ours − torchao| / (2·γ_{K+4}·(|A|·|B|)) over the elements (≤ 1 is the promise) and the relative norm of the
    difference."""
    ours, theirs = _run(_ours_linear(weight), x, gy), _run(_torchao_linear(weight), x, gy)
    ref = _ours_linear(weight)                         # the fp8 values both sides multiply, dequantized, exactly
    x8, sx = ref.fp8["input"].quantize(x)
    w8, sw = ref.fp8["weight"].quantize(weight.detach())
    g8, sg = ref.fp8["grad_output"].quantize(gy)
    xa, wa, ga = (x8.double() / sx).abs(), (w8.double() / sw).abs(), (g8.double() / sg).abs()
    xa2, ga2 = xa.reshape(-1, xa.shape[-1]), ga.reshape(-1, ga.shape[-1])       # (tokens, in), (tokens, out)
    magnitudes = {"y": (xa @ wa.t(), weight.shape[1]), "grad x": (ga @ wa, weight.shape[0]),
                  "grad W": (ga2.t() @ xa2, xa2.shape[0])}
    out = {}
    for (name, (mag, k)), a, b in zip(magnitudes.items(), ours, theirs):
        diff = (a.double() - b.double()).abs()
        bound = 2 * gamma(k + 4) * mag
        out[name] = {"of_bound": (diff / bound.clamp(min=torch.finfo(torch.float64).tiny)).max().item(),
                     "rel": (diff.norm() / b.double().norm()).item(), "K": k}
    return out


def compare_with_torchao(model: nn.Module, x, y) -> dict:
    """compare_linear for every linear inside the blocks of the fp32 `model`, on its inputs and output gradients
    for tokens x, targets y: {layer name: {'y' | 'grad x' | 'grad W': {'of_bound', 'rel', 'K'}}}."""
    return {name: compare_linear(model.get_submodule(name).weight, xin, gy)
            for name, (xin, gy) in linear_inputs(model, x, y).items()}


__all__ = ["gamma", "linear_inputs", "compare_linear", "compare_with_torchao"]
