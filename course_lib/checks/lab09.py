"""Checks for Lab 09: a dynamic loss scaler and block-wise int8 quantization, written by hand.

    check_scaler_trajectory(LossScaler)           the scale after every update equals torch.amp.GradScaler's on the
                                                  same overflow / clean steps (3 settings × 316 steps, one of them
                                                  growing into float32's inf); a failure names the rule it broke
    check_scaler_training(LossScaler)             the nano GPT trained 20 steps in fp16 with your scaler: the same
                                                  losses, scales and skipped steps as with course_lib's
    check_int8_quantizer(quantize, dequantize)    codes and scales equal course_lib's int8 (blocks, a short last
                                                  block; an all-zero block's scale finite and > 0), n + 4·⌈n/B⌉
                                                  bytes, the round trip within a block's step
    check_int8_error_bound(quantize, dequantize, error_bound)
                                                  your per-block bound is N_b/254 exactly and no element exceeds it;
                                                  NaN/inf input raises ValueError
"""
from __future__ import annotations

import math
import random

import torch

from .. import optim
from ..core.data import ShardedBatches
from ..core.model import GPT, get_config
from ..memopt import precision as P
from ..memopt import quantize as Q
from ..train import TrainConfig, optimizer_kwargs, run
from . import check

SETTINGS = [dict(init_scale=2.0 ** 16, growth_factor=2.0, backoff_factor=0.5, growth_interval=3),
            dict(init_scale=2.0 ** 4, growth_factor=2.0, backoff_factor=0.5, growth_interval=1),
            dict(init_scale=2.0 ** 10, growth_factor=4.0, backoff_factor=0.25, growth_interval=5)]


def _flags(seed: int, n: int = 300) -> list[bool]:
    rng = random.Random(seed)
    return [rng.random() < 0.2 for _ in range(n)] + [True] * 4 + [False] * 12


def _scaler_slip(kw: dict, flags: list, step: int, got: list, want: list, trackers: list) -> str:
    """What the learner's update() did wrong at the first step whose scale differs from GradScaler's: replays the
    state machine (scale, counter) up to that step and compares with the learner's scale and growth_tracker."""
    interval, tracker = kw["growth_interval"], 0
    for f in flags[:step]:
        tracker = 0 if f else (tracker + 1) % interval
    before = ([kw["init_scale"]] + want)[step]
    mine = trackers[step - 1] if step else 0
    if flags[step]:
        return (f"on overflow the scale goes from {before:g} to {want[step]:g}: multiply it by backoff_factor "
                f"({kw['backoff_factor']:g}) and set growth_tracker back to 0")
    if want[step] == before and got[step] > before:       # you grew, GradScaler did not
        if math.isinf(got[step]):
            return "the grown scale overflows float32 (inf): grow only if the result is finite"
        if mine is not None and mine != tracker:
            return (f"your growth_tracker was {mine} before this clean step, GradScaler's counter {tracker}: "
                    f"reset it to 0 on every overflow (and after every growth)")
        return (f"you grew after {tracker + 1} clean steps; grow when the counter REACHES growth_interval = "
                f"{interval} (counter + 1, then compare)")
    if want[step] > before and got[step] == before:       # GradScaler grew, you did not
        now_mine = trackers[step]
        if now_mine is not None and now_mine > interval - 1 and now_mine != 0:
            fix = ("reset it to 0 after growing" if now_mine > interval else
                   "grow when it reaches growth_interval (==), not after it passes")
            return f"{interval} clean steps in a row: grow here; your growth_tracker is now {now_mine} — {fix}"
        if mine is not None and mine != tracker:
            return (f"your growth_tracker was {mine} before this clean step, GradScaler's counter {tracker}: "
                    f"add 1 on every clean step, set it to 0 on overflow and after growing")
        return f"{interval} clean steps in a row: multiply the scale by growth_factor ({kw['growth_factor']:g})"
    return (f"the scale went from {before:g} to {got[step]:g}, GradScaler's to {want[step]:g}: clean steps "
            f"multiply by growth_factor ({kw['growth_factor']:g}) only when the counter reaches growth_interval")


def check_scaler_trajectory(LossScaler) -> None:
    with check("scaler_trajectory") as c:
        backoffs = growths = 0
        for i, kw in enumerate(SETTINGS):
            flags = _flags(i)
            want = P.grad_scaler_trajectory(flags, **kw)
            scaler, got, trackers = LossScaler(**kw), [], []
            for f in flags:
                scaler.update(bool(f))
                got.append(float(scaler.scale))
                trackers.append(getattr(scaler, "growth_tracker", None))
            bad = next((s for s, (a, b) in enumerate(zip(got, want)) if a != b), None)
            c.expect(bad is None,
                     f"with {kw}, after step {bad} ({'overflow' if bad is not None and flags[bad] else 'clean'})"
                     f" your scale is {got[bad] if bad is not None else ''},"
                     f" GradScaler's {want[bad] if bad is not None else ''}",
                     hint=_scaler_slip(kw, flags, bad, got, want, trackers) if bad is not None else "")
            backoffs += sum(flags)
            growths += sum(1 for a, b in zip([kw["init_scale"]] + want, want) if b > a)
        c.passed(f"{len(SETTINGS)} settings × {len(_flags(0))} steps equal torch.amp.GradScaler's "
                 f"({backoffs} back-offs, {growths} growths)")


def _train_fp16(scaler, steps: int):
    cfg, tc = get_config("nano"), TrainConfig(steps=steps, batch_size=4)
    mp = P.apply_precision(GPT(cfg), recipe="fp16", scaler=scaler)
    opt = optim.build(mp, **optimizer_kwargs(tc))
    r = run(mp, opt, ShardedBatches(cfg.seq_len, 4), steps=steps, step_fn=mp.step_fn())
    return r.losses, opt.skipped


def check_scaler_training(LossScaler) -> None:
    with check("scaler_training") as c:
        kw = dict(init_scale=2.0 ** 16, growth_factor=2.0, backoff_factor=0.5, growth_interval=4)
        mine, theirs = LossScaler(**kw), P.DynamicLossScaler(**kw)
        for name in ("attach", "unscale_"):
            if not hasattr(mine, name):     # the lab's class inherits them; a class written elsewhere may not
                setattr(mine, name, getattr(P.DynamicLossScaler, name).__get__(mine))
        got_losses, got_skipped = _train_fp16(mine, 20)
        want_losses, want_skipped = _train_fp16(theirs, 20)
        c.expect(got_skipped == want_skipped, f"{got_skipped} of 20 steps were skipped with your scaler, "
                 f"{want_skipped} with the course's", hint="check_scaler_trajectory first")
        c.expect(got_losses == want_losses, "the losses differ from the run with the course's scaler",
                 hint="the scale must change only in update()")
        c.expect(float(mine.scale) == theirs.scale, f"final scale {mine.scale}, expected {theirs.scale}")
        c.passed(f"fp16 GPT, 20 steps: {want_skipped} overflow(s) skipped, "
                 f"final scale 2^{math.log2(theirs.scale):.0f}, "
                 f"losses identical to the course's scaler ({want_losses[0]:.3f} → {want_losses[-1]:.3f})")


def _cases():
    g = torch.Generator().manual_seed(9)
    x = torch.randn(5000, generator=g) * torch.exp2(torch.randint(-8, 3, (5000,), generator=g).float())
    x[17] = 40.0                                        # an outlier: only its block loses resolution
    return [(x, 2048), (x[:4096], 2048), (x[:100], 64), (torch.zeros(300), 128), (x[:7], 1)]


def _scale_slip(x, B, scales, nonzero) -> str:
    """Name the usual slips in Δ_b = max|block| / 127: the max without abs, or another divisor."""
    blocks = x.reshape(-1).float().split(B)
    maxes = torch.stack([blk.max() for blk in blocks]) / 127
    if torch.equal(scales[maxes > 0], maxes[maxes > 0]):
        return "N_b is the largest MAGNITUDE: max|block| (x.abs().max()), not the largest value"
    absmax = torch.stack([blk.abs().max() for blk in blocks])[nonzero]
    divisor = (absmax.double() / scales[nonzero].double()).median().item()
    if math.isfinite(divisor) and abs(divisor - round(divisor)) < 1e-3 and round(divisor) != 127:
        return f"you divide by {round(divisor)}: int8 codes run from −127 to 127, so Δ_b = max|block| / 127"
    return "Δ_b = max|block| / 127 in float32, one per block of B elements"


def _truncated(x, B, ref):
    step = ref.scales.repeat_interleave(B)[:x.numel()]
    return torch.trunc(x.reshape(-1).float() / step).clamp(-127, 127).to(torch.int8)


def check_int8_quantizer(quantize, dequantize) -> None:
    with check("int8_quantizer") as c:
        for x, B in _cases():
            codes, scales = quantize(x, B)
            ref = Q.quantize_blockwise(x, B, "int8")
            nb = math.ceil(x.numel() / B)
            c.expect(codes.dtype == torch.int8 and codes.numel() == x.numel(),
                     f"n={x.numel()}, B={B}: codes should be {x.numel()} int8 values, "
                     f"got {codes.numel()} of {codes.dtype}",
                     hint="one int8 code per element, the short last block included, nothing for padding")
            c.expect(scales.dtype == torch.float32 and scales.numel() == nb,
                     f"n={x.numel()}, B={B}: expected {nb} float32 scales (one per block), got {scales.numel()} of "
                     f"{scales.dtype}", hint="⌈n / B⌉ blocks; the last one may be shorter")
            nonzero = torch.stack([blk.abs().max() > 0 for blk in x.split(B)])
            c.expect(bool(torch.isfinite(scales).all()) and bool((scales[~nonzero] > 0).all()),
                     f"n={x.numel()}, B={B}: an all-zero block got the scale {scales[~nonzero].tolist()[:1]}",
                     hint="an all-zero block needs a finite scale > 0 (e.g. 1/127): x / 0 is 0/0 = NaN, and a "
                          "NaN code is whatever the cast makes of it")
            if not torch.equal(scales[nonzero], ref.scales[nonzero]):
                c.expect(False, f"n={x.numel()}, B={B}: your scales differ from Δ_b = N_b / 127",
                         hint=_scale_slip(x, B, scales, nonzero))
            if not torch.equal(codes, ref.codes):
                c.expect(False, f"n={x.numel()}, B={B}: your codes differ from round(x / Δ_b)",
                         hint="round to nearest (torch.round), do not truncate: .to(torch.int8) alone cuts toward 0"
                         if torch.equal(codes, _truncated(x, B, ref)) else
                         "torch.round (half to even), clamp to [−127, 127], int8")
            back = dequantize(codes, scales, B)
            c.expect(back.shape == x.shape and torch.equal(back, Q.dequantize_blockwise(ref).view_as(back)),
                     f"n={x.numel()}, B={B}: dequantize(codes, scales) is not codes · Δ_b", hint="codes.float() × the "
                     "scale of each element's block (repeat_interleave, then cut to n)")
        n = sum(x.numel() for x, _ in _cases())
        total = sum(x.numel() + 4 * math.ceil(x.numel() / B) for x, B in _cases())
        c.passed(f"{len(_cases())} tensors ({n:,} values, blocks 1–2048, short last blocks): codes and scales equal "
                 f"course_lib's int8, {total:,} B stored = n + 4·⌈n/B⌉")


def check_int8_error_bound(quantize, dequantize, error_bound) -> None:
    with check("int8_error_bound") as c:
        worst = 0.0
        for x, B in _cases():
            codes, scales = quantize(x, B)
            err = (dequantize(codes, scales, B) - x).abs()
            bound = error_bound(x, B)
            nb = math.ceil(x.numel() / B)
            want = torch.stack([blk.abs().max() for blk in x.split(B)]) / 254
            c.expect(bound.numel() == nb, f"n={x.numel()}, B={B}: your bound has {bound.numel()} values, expected one "
                     f"per block ({nb})", hint="one bound per block of B elements, the short last block included")
            close = torch.allclose(bound.double(), want.double(), rtol=1e-6, atol=0)
            c.expect(close, f"n={x.numel()}, B={B}: your bound per block is not N_b / 254",
                     hint="that is a whole step Δ_b = N_b / 127: nearest rounding errs by at most HALF a step, "
                          "N_b / 254" if torch.allclose(bound.double(), 2 * want.double(), rtol=1e-6, atol=0) else
                          "nearest rounding errs by at most half a step: Δ_b / 2 = N_b / 254")
            per_elem = bound.repeat_interleave(B)[:x.numel()]
            slack = per_elem * 2.0 ** -20 + 1e-30        # fp32 rounding of the product codes · Δ_b
            c.expect(bool((err <= per_elem + slack).all()), f"n={x.numel()}, B={B}: an element errs by "
                     f"{(err - per_elem).max().item():.2e} more than your bound", hint="round, do not truncate")
            ratio = (err / per_elem.clamp(min=1e-30)).max().item() if x.any() else 0.0
            worst = max(worst, ratio)
        for bad in (torch.tensor([1.0, math.nan]), torch.tensor([math.inf, 0.0])):
            try:
                quantize(bad, 64)
            except ValueError:
                continue
            c.expect(False, f"quantize({bad.tolist()}) did not raise ValueError",
                     hint="a NaN or inf would become its block's absmax and wipe out the block: refuse it")
        c.passed(f"every element within N_b/254 of its block (worst: {worst:.3f} of the bound); NaN/inf refused")


__all__ = ["check_scaler_trajectory", "check_scaler_training", "check_int8_quantizer", "check_int8_error_bound"]
