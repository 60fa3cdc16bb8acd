"""Number formats, mixed-precision training from scratch, and FP8 training simulated on a CPU.

Three ideas, each checked against a closed form or a reference implementation:

    formats         fp32, tf32, fp16, bf16, fp8 E4M3/E5M2 from their bit layouts (docs/formulas.md §7.2):
                    max = (2 − 2^−m)·2^(emax), min normal 2^(1−bias), min subnormal 2^(1−bias−m), ε = 2^−m,
                    asserted against `torch.finfo`; `round_to(x, fmt)` rounds to nearest-even from the layout alone
                    and equals torch's own casts (and gives tf32, which has no storage type)
    mixed precision Micikevicius et al., "Mixed Precision Training", ICLR 2018 (arXiv 1710.03740) §3: a
                    low-precision compute copy of the weights, an fp32 master copy the optimizer updates, and a
                    dynamic loss scale (formulas §7.1): × S before backward, ÷ S before the step, skip the step and
                    halve S on inf/NaN, double S after `growth_interval` clean steps — the same trajectory as
                    `torch.amp.GradScaler`. Model states with Adam: 2 + 2 + 4 + 4 + 4 = 16 bytes per parameter
                    (fp16 weights and gradients, fp32 master, m and v: ZeRO, SC'20 §3.1, K = 12)
    FP8             Micikevicius et al., "FP8 Formats for Deep Learning", 2022 (arXiv 2209.05433), and Transformer
                    Engine's delayed scaling (formulas §7.3): per tensor, scale = fp8_max / max(amax history) ·
                    2^−margin, taken from amaxes recorded *before* this step; E4M3 for inputs and weights, E5M2 for
                    output gradients, in the linear layers. Simulated: the matmul inputs are real float8 tensors
                    (1 byte each, saved for backward as such); the products are accumulated in fp32 on the CPU

`apply_precision(model, mesh=None, recipe=...)` is how the capstone composes precision with the other techniques
(course_lib.parallel.compose: TP → pipeline split → recomputation → precision → DP/ZeRO outermost): data parallelism
then reduces the gradients of the low-precision compute copy (half the bytes of fp32), and the mesh, when given,
makes every rank of a pipeline or tensor-parallel group agree on whether a step overflowed.

On this CPU, fp16 matrix products have no hardware path and are emulated several times slower than fp32; the fp16
recipe therefore runs them as a GPU's tensor cores do — fp16 inputs, products and sums in fp32, the output rounded
to fp16 (`fp32_accumulation`) — which is the numerics of mixed-precision training (Micikevicius §3.3), not a
shortcut.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

# ============================================================================================ formats
@dataclass(frozen=True)
class Format:
    """A binary floating-point format from its bit layout (1 sign bit + exponent_bits + mantissa_bits).

    finite_only: the 'fn' formats (E4M3) have no infinities — the all-ones exponent holds normal values and only
    S.1111.111 is NaN — so their maximum is (2 − 2^−(m−1))·2^(2^e − 1 − bias) instead of IEEE's
    (2 − 2^−m)·2^(2^e − 2 − bias), and torch saturates out-of-range casts to ±max.
    """
    name: str
    exponent_bits: int
    mantissa_bits: int
    dtype: torch.dtype | None          # None: no storage type (tf32 is a tensor-core input format)
    finite_only: bool = False

    @property
    def bits(self) -> int:
        return 1 + self.exponent_bits + self.mantissa_bits

    @property
    def bias(self) -> int:
        return 2 ** (self.exponent_bits - 1) - 1

    @property
    def max_exponent(self) -> int:
        """The largest unbiased exponent of a finite value."""
        top = 2 ** self.exponent_bits - 1          # the all-ones exponent field
        return top - self.bias if self.finite_only else top - 1 - self.bias

    @property
    def max(self) -> float:
        m = self.mantissa_bits
        frac = 2 - 2.0 ** -(m - 1) if self.finite_only else 2 - 2.0 ** -m   # 'fn': mantissa all-ones is NaN
        return frac * 2.0 ** self.max_exponent

    @property
    def min_normal(self) -> float:
        return 2.0 ** (1 - self.bias)

    @property
    def min_subnormal(self) -> float:
        return 2.0 ** (1 - self.bias - self.mantissa_bits)

    @property
    def eps(self) -> float:
        """Machine epsilon: the gap between 1 and the next larger value; rounding to nearest errs by ≤ ε/2."""
        return 2.0 ** -self.mantissa_bits

    @property
    def bytes(self) -> int:
        return (self.bits + 7) // 8


FORMATS: dict[str, Format] = {
    "fp32": Format("fp32", 8, 23, torch.float32),
    "tf32": Format("tf32", 8, 10, None),
    "fp16": Format("fp16", 5, 10, torch.float16),
    "bf16": Format("bf16", 8, 7, torch.bfloat16),
    "fp8_e4m3": Format("fp8_e4m3", 4, 3, torch.float8_e4m3fn, finite_only=True),
    "fp8_e5m2": Format("fp8_e5m2", 5, 2, torch.float8_e5m2),
}
_ALIASES = {"float32": "fp32", "float": "fp32", "float16": "fp16", "half": "fp16", "bfloat16": "bf16",
            "e4m3": "fp8_e4m3", "float8_e4m3fn": "fp8_e4m3", "e5m2": "fp8_e5m2", "float8_e5m2": "fp8_e5m2"}


def get_format(fmt: "str | torch.dtype | Format") -> Format:
    """A Format by name ('fp16', 'bf16', 'fp8_e4m3', …), alias ('half', 'e5m2') or torch dtype."""
    if isinstance(fmt, Format):
        return fmt
    if isinstance(fmt, torch.dtype):
        for f in FORMATS.values():
            if f.dtype == fmt:
                return f
        raise ValueError(f"no course format for dtype {fmt}; supported: "
                         f"{[str(f.dtype) for f in FORMATS.values() if f.dtype is not None]}")
    name = _ALIASES.get(str(fmt).lower(), str(fmt).lower())
    if name not in FORMATS:
        raise ValueError(f"unsupported format {fmt!r}; use one of {sorted(FORMATS)} "
                         f"(aliases: {sorted(_ALIASES)})")
    return FORMATS[name]


def round_to(x, fmt) -> torch.Tensor:
    """Round `x` (float64) to the nearest value of `fmt`, ties to even, from the bit layout alone.

    The spacing of representable values around |x| is 2^(e − m) with e = ⌊log₂|x|⌋, floored at the smallest normal
    exponent 1 − bias (below it the spacing stays fixed: the subnormals). Overflow: IEEE formats go to ±inf at
    max + half a step; finite-only formats (E4M3) saturate to ±max, as torch's cast does. NaN stays NaN.
    """
    f = get_format(fmt)
    x = torch.as_tensor(x, dtype=torch.float64)
    a = x.abs()
    _, e = torch.frexp(a)                                   # a = frac·2^e with frac in [0.5, 1)
    exp = torch.clamp(e - 1, min=1 - f.bias)                # ⌊log₂ a⌋, floored at the min normal exponent
    quantum = torch.ldexp(torch.ones_like(a), exp - f.mantissa_bits)
    r = torch.round(a / quantum) * quantum                  # torch.round: half to even
    r = r.clamp(max=f.max) if f.finite_only else torch.where(r > f.max, torch.inf, r)
    out = torch.copysign(r, x)
    if f.finite_only:                                       # no infinities: ±inf saturates too
        out = torch.where(torch.isinf(x), torch.copysign(torch.tensor(f.max, dtype=torch.float64), x), out)
    return torch.where(torch.isnan(x), x, out)


def spacing(x, fmt) -> torch.Tensor:
    """The gap between representable values of `fmt` around |x| (the ulp; rounding errs by at most half of it)."""
    f = get_format(fmt)
    a = torch.as_tensor(x, dtype=torch.float64).abs()
    _, e = torch.frexp(a)
    return torch.ldexp(torch.ones_like(a), torch.clamp(e - 1, min=1 - f.bias) - f.mantissa_bits)


def cast(x: torch.Tensor, fmt) -> torch.Tensor:
    """`x` as torch stores it in `fmt`, read back as float64 (tf32: by `round_to`, it has no storage type)."""
    f = get_format(fmt)
    if f.dtype is None:
        return round_to(x, f)
    return torch.as_tensor(x).to(f.dtype).to(torch.float64)


def saturating_cast(x: torch.Tensor, fmt) -> torch.Tensor:
    """Cast to an fp8 dtype with values beyond ±max clipped to ±max (E5M2's plain cast would give inf) and
    non-finite values turned into NaN (so a loss scaler's inf/NaN check still sees them)."""
    f = get_format(fmt)
    clipped = x.clamp(-f.max, f.max)
    return torch.where(torch.isfinite(x), clipped, torch.full_like(x, torch.nan)).to(f.dtype)


# ============================================================================================ the loss scaler
def _f32(v: float) -> float:
    """Round to float32, as GradScaler keeps its scale in a float32 tensor."""
    return float(torch.tensor(v, dtype=torch.float32))


class DynamicLossScaler:
    """Dynamic loss scaling (Micikevicius et al. 2018 §3.2; PyTorch's GradScaler rule, formulas §7.1).

        backward on S·loss          small gradients are multiplied by S, so they stay above fp16's 2^−24
        unscale: g ← g / S          in fp32, on the master copy's gradients (exact: S is a power of two)
        inf or NaN in any g?        yes: skip the optimizer step, S ← S · backoff_factor, counter ← 0
                                    no:  step; counter += 1; when counter == growth_interval: S ← S · growth_factor
                                         (unless that overflows), counter ← 0

    Usable from any training loop: `scale_loss(loss)` before backward (a custom step_fn), or `attach(loss)`, which
    multiplies the gradient entering `loss` by S so that `loss.backward()` in the plain loop backpropagates S·loss
    while the loop still reports the true loss; then `unscale_(grads)` → found_inf and `update(found_inf)`.
    """

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000):
        if not (math.isfinite(init_scale) and init_scale > 0):
            raise ValueError(f"init_scale must be a positive finite number, got {init_scale!r}")
        if not growth_factor > 1.0:
            raise ValueError(f"growth_factor must be > 1 (the scale grows after clean steps), got {growth_factor!r}")
        if not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"backoff_factor must be in (0, 1) (the scale shrinks on overflow), got {backoff_factor!r}")
        if not isinstance(growth_interval, int) or growth_interval < 1:
            raise ValueError(f"growth_interval must be a positive integer, got {growth_interval!r}")
        self.scale = _f32(init_scale)
        self.growth_factor, self.backoff_factor, self.growth_interval = growth_factor, backoff_factor, growth_interval
        self.growth_tracker = 0              # clean steps since the last change of scale
        self.history: list[tuple[float, bool]] = []   # (scale used, found_inf) for every update

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale

    def attach(self, loss: torch.Tensor) -> torch.Tensor:
        """Make `loss.backward()` backpropagate S·loss (a hook on the gradient entering `loss`); returns `loss`."""
        if loss.requires_grad:
            loss.register_hook(lambda g: g * self.scale)
        return loss

    @torch.no_grad()
    def unscale_(self, grads) -> bool:
        """Divide every gradient by S in place (fp32 tensors, please); True if any holds an inf or a NaN."""
        inv = _f32(1.0 / self.scale)                 # GradScaler multiplies by the float32 reciprocal
        found_inf = False
        for g in grads:
            if g is None:
                continue
            g.mul_(inv)
            found_inf = found_inf or not bool(torch.isfinite(g).all())
        return found_inf

    def update(self, found_inf: bool) -> None:
        """The state machine: back off on overflow, grow after `growth_interval` clean steps in a row."""
        self.history.append((self.scale, bool(found_inf)))
        if found_inf:
            self.scale = _f32(self.scale * self.backoff_factor)
            self.growth_tracker = 0
            return
        self.growth_tracker += 1
        if self.growth_tracker == self.growth_interval:
            grown = _f32(self.scale * self.growth_factor)
            if math.isfinite(grown):
                self.scale = grown
            self.growth_tracker = 0

    @property
    def skipped_steps(self) -> int:
        return sum(inf for _, inf in self.history)

    def state_dict(self) -> dict:
        return {"scale": self.scale, "growth_tracker": self.growth_tracker}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.growth_tracker = _f32(state["scale"]), int(state["growth_tracker"])


def scaler_trajectory(scaler, found_infs) -> list[float]:
    """The scale after each `update(found_inf)` of any scaler with `.scale` and `.update` (ours, or a learner's)."""
    out = []
    for inf in found_infs:
        scaler.update(bool(inf))
        out.append(float(scaler.scale))
    return out


def grad_scaler_trajectory(found_infs, *, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0,
                           backoff_factor: float = 0.5, growth_interval: int = 2000) -> list[float]:
    """The reference: torch.amp.GradScaler("cpu") fed the same overflow / no-overflow steps (a one-element model
    whose gradient is inf or finite); its scale after each `update()`."""
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.0)
    gs = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_factor=growth_factor,
                              backoff_factor=backoff_factor, growth_interval=growth_interval)
    out = []
    for inf in found_infs:
        gs.scale(torch.zeros(()))                    # GradScaler creates its scale tensor on first use
        p.grad = torch.full((1,), math.inf if inf else 1.0)
        gs.step(opt)                                 # unscale_, find the inf, skip or step
        gs.update()
        out.append(float(gs.get_scale()))
    return out


# ============================================================================================ recipes and bytes
@dataclass(frozen=True)
class Recipe:
    """What each tensor of training is stored in.

    compute_dtype: the weights, activations and gradients that forward and backward touch (the compute copy);
    master_weights: an fp32 copy the optimizer updates (and whose dtype its state then has);
    loss_scaling: dynamic loss scaling (needed by fp16's narrow range, not by bf16's fp32-sized exponent).
    """
    name: str
    compute_dtype: torch.dtype
    master_weights: bool
    loss_scaling: bool
    description: str = ""

    @property
    def compute_bytes(self) -> int:
        return torch.empty(0, dtype=self.compute_dtype).element_size()

    @property
    def state_bytes(self) -> int:
        """Bytes per element of the optimizer's own state (Adam's m and v live in the dtype of what it updates)."""
        return 4 if self.master_weights else self.compute_bytes


RECIPES: dict[str, Recipe] = {
    "fp32": Recipe("fp32", torch.float32, False, False, "everything in fp32"),
    "bf16": Recipe("bf16", torch.bfloat16, True, False, "bf16 compute copy, fp32 master weights"),
    "fp16": Recipe("fp16", torch.float16, True, True, "fp16 compute copy, fp32 master weights, dynamic loss scale"),
    "fp16-unscaled": Recipe("fp16-unscaled", torch.float16, True, False, "fp16 + fp32 master, no loss scaling"),
    "bf16-pure": Recipe("bf16-pure", torch.bfloat16, False, False, "bf16 weights, gradients and Adam state"),
}


def get_recipe(recipe: "str | Recipe") -> Recipe:
    if isinstance(recipe, Recipe):
        return recipe
    if recipe not in RECIPES:
        raise ValueError(f"unknown precision recipe {recipe!r}; use one of {sorted(RECIPES)}")
    return RECIPES[recipe]


def model_state_bytes(recipe: "str | Recipe", numels, *, optimizer: str = "adamw", block_size: int = 2048) -> dict:
    """Exact bytes of the model states after an optimizer step, as the memory accountant labels them:

        parameters  Σn · e_compute                  (the compute copy)
        gradients   Σn · e_compute
        optimizer   fp32 master 4Σn (if any) + adamw: m and v 2Σn·e_state + a 4-byte `step` tensor per tensor
                                               adam8bit: 2Σn (one byte each) + 2 fp32 absmax per block of each
                                                         tensor (formulas §7.4; its step count is a Python int)
    `numels`: the parameter tensors' element counts.
    """
    r = get_recipe(recipe)
    numels = [int(n) for n in numels]
    psi = sum(numels)
    master = 4 * psi if r.master_weights else 0
    if optimizer == "adamw":
        state = 2 * psi * r.state_bytes + 4 * len(numels)
    elif optimizer == "adam8bit":
        state = 2 * psi + 2 * 4 * sum(-(-n // block_size) for n in numels)
    else:
        raise ValueError(f"unknown optimizer {optimizer!r}; use 'adamw' or 'adam8bit'")
    return {"parameters": psi * r.compute_bytes, "gradients": psi * r.compute_bytes, "optimizer": master + state}


def bytes_per_parameter(recipe: "str | Recipe", optimizer: str = "adamw", block_size: int = 2048) -> dict:
    """The per-parameter split in the ZeRO paper's style (no per-tensor `step` counters): weights, gradients,
    master, optimizer state — e.g. fp16 with Adam: 2 + 2 + 4 + 8 = 16 bytes (Rajbhandari et al., SC'20 §3.1)."""
    r = get_recipe(recipe)
    if optimizer not in ("adamw", "adam8bit"):
        raise ValueError(f"unknown optimizer {optimizer!r}; use 'adamw' or 'adam8bit'")
    state = 2 * r.state_bytes if optimizer == "adamw" else 2 + 8 / block_size     # 8-bit: 2 B + 2 fp32 per block
    row = {"weights": r.compute_bytes, "gradients": r.compute_bytes, "master": 4 if r.master_weights else 0,
           "optimizer state": state}
    row["total"] = sum(row.values())
    return row


# ============================================================================================ fp16 on a CPU
_MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.bmm.default, torch.ops.aten.addmm.default,
            torch.ops.aten.baddbmm.default}         # what matmul, linear and @ reach at the dispatcher


class _Fp32Accumulation(TorchDispatchMode):
    """fp16 matrix products on the CPU as a tensor core computes them: fp16 inputs, every product and sum in fp32,
    the result rounded once to fp16. (An fp16·fp16 product has ≤ 22 significant bits, exact in fp32.)"""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _MATMULS and any(isinstance(a, torch.Tensor) and a.dtype == torch.float16 and a.device.type == "cpu"
                                    for a in args):
            up = [a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
            return func(*up, **kwargs).to(torch.float16)
        return func(*args, **kwargs)


@contextlib.contextmanager
def fp32_accumulation():
    """Run fp16 matmuls (mm, bmm, addmm, baddbmm) with fp32 accumulation inside the block — forward and backward."""
    with _Fp32Accumulation():
        yield


# ============================================================================================ mixed precision
class MixedPrecisionModel(nn.Module):
    """The compute copy: `module`'s own parameters cast in place to the recipe's dtype, with the fp32 originals kept
    as `master_params` for the optimizer (`make_optimizer`).

    forward(idx, targets) → (logits, loss): the logits come out of the low-precision model, the loss is computed
    from them in fp32 (a softmax over the vocabulary is a reduction, which mixed precision keeps in fp32, Micikevicius
    §3.3), and with loss scaling the scaler is attached to it, so the plain training loop's `loss.backward()`
    backpropagates S·loss. Use `step_fn()` as `train.run`'s step_fn: for fp16 it runs forward and backward under
    `fp32_accumulation` (on this CPU; a GPU does that in its tensor cores).
    """

    def __init__(self, module: nn.Module, recipe: "str | Recipe" = "bf16", *, scaler: DynamicLossScaler | None = None,
                 mesh=None):
        super().__init__()
        self.recipe = get_recipe(recipe)
        if any(p.dtype != torch.float32 for p in module.parameters()):
            raise ValueError("apply_precision expects an fp32 model (it keeps the fp32 values as master weights); "
                             f"got parameters of {sorted({str(p.dtype) for p in module.parameters()})}")
        self.master_params = [p.detach().clone() for p in module.parameters()] if self.recipe.master_weights else []
        self.module = module.to(self.recipe.compute_dtype)
        self.scaler = (scaler or DynamicLossScaler()) if self.recipe.loss_scaling else None
        self.mesh = mesh

    def forward(self, idx, targets=None):
        from ..model import lm_loss
        logits, _ = self.module(idx)
        if targets is None:
            return logits, None
        loss = lm_loss(logits.float(), targets)                       # (B, T, V) → fp32 mean over B·T tokens
        return logits, (self.scaler.attach(loss) if self.scaler is not None else loss)

    def step_fn(self, inner=None):
        """A `train.run` step_fn: `inner` (default: `train.forward_backward`) under fp32 accumulation for fp16."""
        from ..train import forward_backward
        inner = inner or forward_backward
        if self.recipe.compute_dtype != torch.float16:
            return inner

        def step(model, batches, step, phase):
            with fp32_accumulation():
                return inner(model, batches, step, phase)
        return step

    def make_optimizer(self, optimizer_cls=torch.optim.AdamW, **optimizer_kwargs) -> torch.optim.Optimizer:
        """fp32 master weights: a MixedPrecisionOptimizer; otherwise `optimizer_cls` over the model's parameters."""
        if not self.recipe.master_weights:
            return optimizer_cls(self.module.parameters(), **optimizer_kwargs)
        return MixedPrecisionOptimizer(self.module.parameters(), self.master_params, optimizer_cls,
                                       scaler=self.scaler, mesh=self.mesh, **optimizer_kwargs)


def apply_precision(model: nn.Module, mesh=None, *, recipe: "str | Recipe" = "bf16",
                    scaler: DynamicLossScaler | None = None) -> MixedPrecisionModel:
    """Precision for the composed model (compose.py's step 4, before data parallelism wraps it): returns the
    MixedPrecisionModel; build its optimizer with `.make_optimizer(...)` and train with `step_fn=.step_fn()`.
    `mesh` (a course Mesh): the overflow check of a step is agreed over its 'pp' and 'tp' axes, whose ranks hold
    different parameters (dp ranks hold the same, already averaged, gradients)."""
    return MixedPrecisionModel(model, recipe, scaler=scaler, mesh=mesh)


class MixedPrecisionOptimizer(torch.optim.Optimizer):
    """An optimizer over fp32 master weights for a model whose parameters are a low-precision compute copy.

    step():  g32 = compute-copy grad in fp32, ÷ S          (the fp16 gradients themselves are never unscaled:
                                                             ÷ S in fp16 would flush the small ones to zero again)
             inf/NaN anywhere?  skip, S ← S/2               (agreed over the mesh's pp and tp axes, if given)
             else               inner optimizer step on the masters, then compute copy ← round(master)
    The fp32 gradient copies live only during step(). Memory after a step (what `model_state_bytes` counts):
    compute copy and its gradients 2Ψ each (fp16/bf16), masters 4Ψ, plus the inner optimizer's state; `state[p]`
    holds p's master and the inner state, so a memory accountant finds all of it.
    """

    def __init__(self, params, master_params, optimizer_cls=torch.optim.AdamW, *, scaler=None, mesh=None,
                 **optimizer_kwargs):
        params = list(params)
        if len(params) != len(master_params):
            raise ValueError(f"{len(params)} parameters but {len(master_params)} master copies")
        super().__init__(params, {})
        self.masters = list(master_params)
        for p, m in zip(params, self.masters):
            if p.shape != m.shape or m.dtype != torch.float32:
                raise ValueError(f"master copy {tuple(m.shape)} {m.dtype} does not match parameter {tuple(p.shape)}")
            self.state[p]["master"] = m
        self.optimizer = optimizer_cls(self.masters, **optimizer_kwargs)
        self.scaler, self.mesh = scaler, mesh
        self.skipped = 0

    def _agree(self, found_inf: bool) -> bool:
        if self.mesh is None:
            return found_inf
        flag = torch.tensor([float(found_inf)])
        for axis in ("pp", "tp"):
            if self.mesh.size(axis) > 1:
                self.mesh[axis].all_reduce(flag, "max", tag="found_inf")
        return bool(flag.item())

    @torch.no_grad()
    def step(self, closure=None):
        params = self.param_groups[0]["params"]
        for p, m in zip(params, self.masters):
            m.grad = None if p.grad is None else p.grad.float()       # (n,) fp32 copy of the compute gradient
        grads = [m.grad for m in self.masters]
        if self.scaler is not None:
            found_inf = self.scaler.unscale_(grads)
        else:
            found_inf = not all(bool(torch.isfinite(g).all()) for g in grads if g is not None)
        found_inf = self._agree(found_inf)
        if self.scaler is not None:
            self.scaler.update(found_inf)
        if found_inf:
            self.skipped += 1
        else:
            self.optimizer.step()
            for p, m in zip(params, self.masters):
                p.copy_(m)                                            # round the master to the compute dtype
        for p, m in zip(params, self.masters):
            m.grad = None
            self.state[p].update((k, v) for k, v in self.optimizer.state[m].items())
        return None


# ============================================================================================ activation and
#                                                                                              parameter gradients
def backward_gradients(module: nn.Module, idx: torch.Tensor, targets: torch.Tensor, *, scale: float = 1.0) -> dict:
    """One backward of a GPT-shaped module (any dtype) on S·loss, the loss taken in fp32 from its logits; returns
    float64 copies, divided by S, of the gradients as the module's dtype held them: 'activations' (the logits and
    every block's output: what backward passes from layer to layer) and 'parameters'. A value that underflowed in
    fp16 is exactly 0 here."""
    from ..model import lm_loss
    acts = []
    hooks = [b.register_full_backward_hook(lambda mod, gin, gout: acts.append(gout[0].detach().double().flatten()))
             for b in module.blocks]
    module.zero_grad(set_to_none=True)
    ctx = fp32_accumulation() if next(module.parameters()).dtype == torch.float16 else contextlib.nullcontext()
    try:
        with ctx:
            logits, _ = module(idx)
            logits.retain_grad()
            (lm_loss(logits.float(), targets) * scale).backward()
    finally:
        for h in hooks:
            h.remove()
    out = {"activations": torch.cat([logits.grad.double().flatten()] + acts) / scale,
           "parameters": torch.cat([p.grad.double().flatten() for p in module.parameters()]) / scale}
    module.zero_grad(set_to_none=True)
    return out


def underflow_fraction(reference: torch.Tensor, low: torch.Tensor) -> float:
    """Of the elements that are non-zero in the fp32 reference, the fraction that are exactly 0 in low precision."""
    nonzero = reference != 0
    return float(((low == 0) & nonzero).sum()) / max(1, int(nonzero.sum()))


# ============================================================================================ FP8
class Fp8Scaling:
    """One tensor's FP8 scaling factor (formulas §7.3).

    delayed=True (Transformer Engine's DelayedScaling): scale = fp8_max / max(last `history_len` amaxes) · 2^−margin,
    from amaxes recorded BEFORE this cast; the current amax is appended afterwards. With no history yet the scale is
    1 (TE's initial value). delayed=False: the current tensor's own amax (torchao's dynamic "tensorwise" scaling).
    Values beyond the range saturate; a non-finite input is cast to NaN and its amax is not recorded.
    """

    def __init__(self, fmt="fp8_e4m3", *, delayed: bool = True, history_len: int = 16, margin: int = 0):
        self.fmt = get_format(fmt)
        if self.fmt.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise ValueError(f"FP8 scaling needs fp8_e4m3 or fp8_e5m2, got {self.fmt.name}")
        if not isinstance(history_len, int) or history_len < 1:
            raise ValueError(f"history_len must be a positive integer, got {history_len!r}")
        self.delayed, self.history_len, self.margin = delayed, history_len, margin
        # a scaled value beyond the last rounding interval (max + half a step) is clipped, not rounded
        self.beyond = self.fmt.max + float(spacing(self.fmt.max, self.fmt)) / 2
        self.amax_history: list[float] = []      # finite amaxes, newest last
        self.scales: list[float] = []            # the scale used at each cast
        self.amaxes: list[float] = []            # the tensor's own amax at each cast
        self.saturated: list[int] = []           # elements clipped at each cast (beyond max + half a step)

    def _scale_for(self, amax: float) -> float:
        if not amax > 0 or not math.isfinite(amax):
            return 1.0
        # as torchao: fp8_max / amax in float64, then float32
        return _f32(self.fmt.max / amax * 2.0 ** -self.margin)

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, float]:
        """(x·scale as a float8 tensor, scale); x ≈ x_fp8 / scale."""
        amax = float(x.detach().abs().max()) if x.numel() else 0.0
        ref = max(self.amax_history[-self.history_len:], default=0.0) if self.delayed else amax
        scale = self._scale_for(ref)
        scaled = x.detach().float() * scale
        self.scales.append(scale)
        self.amaxes.append(amax)
        self.saturated.append(int((scaled.abs() > self.beyond).sum()) if amax * scale > self.beyond else 0)
        if math.isfinite(amax):
            self.amax_history.append(amax)
            del self.amax_history[:-self.history_len]
        return saturating_cast(scaled, self.fmt), scale


class _Fp8Matmul(torch.autograd.Function):
    """y = x·Wᵀ with x, W cast to E4M3 and, in backward, ∂y cast to E5M2; the float8 tensors are what is saved."""

    @staticmethod
    def forward(ctx, x, weight, mod):
        x8, sx = mod.fp8["input"].quantize(x)                       # (..., in) float8_e4m3fn
        w8, sw = mod.fp8["weight"].quantize(weight)                 # (out, in) float8_e4m3fn
        ctx.save_for_backward(x8, w8)
        ctx.scales, ctx.mod, ctx.dtypes = (sx, sw), mod, (x.dtype, weight.dtype)
        y = (x8.float() / sx) @ (w8.float() / sw).t()               # (..., in) @ (in, out): fp32 accumulation
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, grad_y):
        x8, w8 = ctx.saved_tensors
        sx, sw = ctx.scales
        g8, sg = ctx.mod.fp8["grad_output"].quantize(grad_y)        # (..., out) float8_e5m2
        g, x, w = g8.float() / sg, x8.float() / sx, w8.float() / sw
        grad_x = g @ w                                              # (..., out) @ (out, in) → (..., in)
        grad_w = g.reshape(-1, g.shape[-1]).t() @ x.reshape(-1, x.shape[-1])   # (out, N) @ (N, in) → (out, in)
        return grad_x.to(ctx.dtypes[0]), grad_w.to(ctx.dtypes[1]), None


def _scalings(*, delayed: bool = True, history_len: int = 16, margin: int = 0) -> dict:
    """One Fp8Scaling per tensor of a linear layer: E4M3 for its input and weight, E5M2 for its output gradient."""
    kw = dict(delayed=delayed, history_len=history_len, margin=margin)
    return {"input": Fp8Scaling("fp8_e4m3", **kw), "weight": Fp8Scaling("fp8_e4m3", **kw),
            "grad_output": Fp8Scaling("fp8_e5m2", **kw)}


class Fp8Linear(nn.Linear):
    """nn.Linear whose matmul runs in simulated FP8 (forward E4M3, backward E5M2), one Fp8Scaling per tensor.
    The bias is added outside the FP8 product, in the input's dtype (so its gradient is the unquantized one)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, delayed: bool = True,
                 history_len: int = 16, margin: int = 0):
        super().__init__(in_features, out_features, bias=bias)
        self.fp8 = _scalings(delayed=delayed, history_len=history_len, margin=margin)

    @classmethod
    def from_linear(cls, lin: nn.Linear, **kw) -> "Fp8Linear":
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = lin.in_features, lin.out_features
        new.weight, new.bias = lin.weight, lin.bias                 # the same Parameter objects
        new.fp8 = _scalings(**kw)
        return new

    def forward(self, x):
        y = _Fp8Matmul.apply(x, self.weight, self)
        return y if self.bias is None else y + self.bias.to(y.dtype)


def apply_fp8(model: nn.Module, *, delayed: bool = True, history_len: int = 16, margin: int = 0,
              filter=None) -> nn.Module:
    """Swap every nn.Linear whose name passes `filter` (default: those inside the transformer blocks — the LM head
    stays in high precision, a common choice) for an Fp8Linear sharing its parameters. In place; returns `model`."""
    filter = filter or (lambda name: "blocks." in name)
    swaps = [(name, mod) for name, mod in model.named_modules() if type(mod) is nn.Linear and filter(name)]
    if not swaps:
        raise ValueError("apply_fp8 found no nn.Linear to convert (check `filter`)")
    for name, lin in swaps:
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child,
                Fp8Linear.from_linear(lin, delayed=delayed, history_len=history_len, margin=margin))
    return model


def fp8_scalings(model: nn.Module) -> dict:
    """{linear name: {'input' | 'weight' | 'grad_output': Fp8Scaling}} of every Fp8Linear in `model`."""
    return {name: mod.fp8 for name, mod in model.named_modules() if isinstance(mod, Fp8Linear)}


__all__ = ["Format", "FORMATS", "get_format", "round_to", "spacing", "cast", "saturating_cast", "DynamicLossScaler",
           "scaler_trajectory", "grad_scaler_trajectory", "Recipe", "RECIPES", "get_recipe", "model_state_bytes",
           "bytes_per_parameter", "fp32_accumulation", "MixedPrecisionModel", "MixedPrecisionOptimizer",
           "apply_precision", "backward_gradients", "underflow_fraction", "Fp8Scaling", "Fp8Linear", "apply_fp8",
           "fp8_scalings"]
