"""Number formats from their bit layouts: fp32, tf32, fp16, bf16, fp8 E4M3/E5M2 (docs/formulas.md §7.2).

    max = (2 − 2^−m)·2^(emax), min normal 2^(1−bias), min subnormal 2^(1−bias−m), ε = 2^−m

asserted against `torch.finfo`; `round_to(x, fmt)` rounds to nearest-even from the layout alone and equals torch's
own casts (and gives tf32, which has no storage type). FP8: Micikevicius et al., "FP8 Formats for Deep Learning",
2022 (arXiv 2209.05433), Table 1.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


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


def get_format(fmt: str | torch.dtype | Format) -> Format:
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


def _f32(v: float) -> float:
    """Round to float32, as GradScaler keeps its scale in a float32 tensor (and torchao its fp8 scales)."""
    return float(torch.tensor(v, dtype=torch.float32))


__all__ = ["Format", "FORMATS", "get_format", "round_to", "spacing", "cast", "saturating_cast"]
