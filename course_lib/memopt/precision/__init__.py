"""Number formats, mixed-precision training from scratch, and FP8 training simulated on a CPU (notebook 09).

    formats      fp32, tf32, fp16, bf16, fp8 E4M3/E5M2 from their bit layouts (docs/formulas.md §7.2), and
                 round-to-nearest-even from the layout alone, equal to torch's casts
    loss_scale   dynamic loss scaling (Micikevicius et al. 2018 §3.2; formulas §7.1), the same trajectory as
                 `torch.amp.GradScaler`
    recipes      what each tensor is stored in (fp32, bf16, fp16, fp16-unscaled, bf16-pure) and its exact bytes:
                 2 + 2 + 4 + 4 + 4 = 16 per parameter with Adam (ZeRO, SC'20 §3.1)
    mixed        `apply_precision(model, mesh, recipe=...)`: the model cast in place to its compute copy, the fp32
                 masters kept for the optimizer (course_lib.optim), the loss in fp32, fp16's fp32 accumulation
    fp8          FP8 linears with Transformer Engine's delayed scaling (Micikevicius et al. 2022; formulas §7.3)

The optimizer side — fp32 master weights, the unscale-and-skip step and the overflow vote over every rank of the
mesh — is course_lib.optim (`MixedPrecisionOptimizer`, `overflow_vote`), re-exported here. Composition
(course_lib.composer.parallelize.ORDER): TP → pipeline split → recomputation → precision → DP/ZeRO outermost,
optimizer last.
"""
from __future__ import annotations

from .formats import FORMATS, Format, _f32, cast, get_format, round_to, saturating_cast, spacing  # noqa: F401
from .fp8 import Fp8Linear, Fp8Matmul, Fp8Scaling, apply_fp8, fp8_scalings  # noqa: F401
from .loss_scale import DynamicLossScaler, grad_scaler_trajectory, scaler_trajectory
from .mixed import MixedPrecisionModel, apply_precision, backward_gradients, fp32_accumulation, underflow_fraction
from .recipes import RECIPES, Recipe, bytes_per_parameter, get_recipe, model_state_bytes

_FROM_OPTIM = ("MixedPrecisionOptimizer", "overflow_vote")


def __getattr__(name):
    # The optimizer half lives in course_lib.optim, which imports this package's recipes: re-exported on first
    # use, so that importing either package first works.
    if name in _FROM_OPTIM:
        from ... import optim
        return getattr(optim, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["Format", "FORMATS", "get_format", "round_to", "spacing", "cast", "saturating_cast", "DynamicLossScaler",
           "scaler_trajectory", "grad_scaler_trajectory", "Recipe", "RECIPES", "get_recipe", "model_state_bytes",
           "bytes_per_parameter", "fp32_accumulation", "MixedPrecisionModel", "MixedPrecisionOptimizer",
           "overflow_vote", "apply_precision", "backward_gradients", "underflow_fraction", "Fp8Scaling", "Fp8Linear",
           "apply_fp8", "fp8_scalings"]
