"""Checks for Lab 09: a dynamic loss scaler and block-wise int8 quantization, written by hand.

    check_scaler_trajectory(LossScaler)           the scale after every update equals torch.amp.GradScaler's on the
                                                  same overflow / clean steps (3 settings × 300 steps)
    check_scaler_training(LossScaler)             the nano GPT trained 20 steps in fp16 with your scaler: the same
                                                  losses, scales and skipped steps as with course_lib's
    check_int8_quantizer(quantize, dequantize)    codes and scales equal course_lib's int8 (blocks, a short last
                                                  block), n + 4·⌈n/B⌉ bytes, the round trip within a block's step
    check_int8_error_bound(quantize, dequantize, error_bound)
                                                  your per-block bound is N_b/254 exactly and no element exceeds it;
                                                  NaN/inf input raises ValueError
"""
from __future__ import annotations

import math
import random

import torch

from ..data import ShardedBatches
from ..memopt import precision as P
from ..memopt import quantize as Q
from ..model import GPT, get_config
from ..train import TrainConfig, optimizer_kwargs, run
from . import check

SETTINGS = [dict(init_scale=2.0 ** 16, growth_factor=2.0, backoff_factor=0.5, growth_interval=3),
            dict(init_scale=2.0 ** 4, growth_factor=2.0, backoff_factor=0.5, growth_interval=1),
            dict(init_scale=2.0 ** 10, growth_factor=4.0, backoff_factor=0.25, growth_interval=5)]


def _flags(seed: int, n: int = 300) -> list[bool]:
    rng = random.Random(seed)
    return [rng.random() < 0.2 for _ in range(n)] + [True] * 4 + [False] * 12


def check_scaler_trajectory(LossScaler) -> None:
    with check("scaler_trajectory") as c:
        backoffs = growths = 0
        for i, kw in enumerate(SETTINGS):
            flags = _flags(i)
            want = P.grad_scaler_trajectory(flags, **kw)
            got = P.scaler_trajectory(LossScaler(**kw), flags)
            bad = next((s for s, (a, b) in enumerate(zip(got, want)) if a != b), None)
            c.expect(bad is None, f"with {kw}, after step {bad} ({'overflow' if bad is not None and flags[bad] else 'clean'})"
                     f" your scale is {got[bad] if bad is not None else ''}, GradScaler's {want[bad] if bad is not None else ''}",
                     hint="overflow: scale × backoff_factor and the counter back to 0; clean: counter + 1, and when it "
                          "reaches growth_interval: scale × growth_factor and the counter back to 0")
            backoffs += sum(flags)
            growths += sum(1 for a, b in zip([kw["init_scale"]] + want, want) if b > a)
        c.passed(f"{len(SETTINGS)} settings × {len(_flags(0))} steps equal torch.amp.GradScaler's "
                 f"({backoffs} back-offs, {growths} growths)")


def _train_fp16(scaler, steps: int):
    cfg, tc = get_config("nano"), TrainConfig(steps=steps, batch_size=4)
    mp = P.apply_precision(GPT(cfg), recipe="fp16", scaler=scaler)
    opt = mp.make_optimizer(**optimizer_kwargs(tc))
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
        c.passed(f"fp16 GPT, 20 steps: {want_skipped} overflow(s) skipped, final scale 2^{math.log2(theirs.scale):.0f}, "
                 f"losses identical to the course's scaler ({want_losses[0]:.3f} → {want_losses[-1]:.3f})")


def _cases():
    g = torch.Generator().manual_seed(9)
    x = torch.randn(5000, generator=g) * torch.exp2(torch.randint(-8, 3, (5000,), generator=g).float())
    x[17] = 40.0                                        # an outlier: only its block loses resolution
    return [(x, 2048), (x[:4096], 2048), (x[:100], 64), (torch.zeros(300), 128), (x[:7], 1)]


def check_int8_quantizer(quantize, dequantize) -> None:
    with check("int8_quantizer") as c:
        for x, B in _cases():
            codes, scales = quantize(x, B)
            ref = Q.quantize_blockwise(x, B, "int8")
            nb = math.ceil(x.numel() / B)
            c.expect(codes.dtype == torch.int8 and codes.numel() == x.numel(),
                     f"n={x.numel()}, B={B}: codes should be {x.numel()} int8 values, got {codes.numel()} of {codes.dtype}",
                     hint="one int8 code per element, the short last block included, nothing for padding")
            c.expect(scales.dtype == torch.float32 and scales.numel() == nb,
                     f"n={x.numel()}, B={B}: expected {nb} float32 scales (one per block), got {scales.numel()} of "
                     f"{scales.dtype}", hint="⌈n / B⌉ blocks; the last one may be shorter")
            nonzero = torch.stack([blk.abs().max() > 0 for blk in x.split(B)])
            c.expect(bool(torch.isfinite(scales).all()) and torch.equal(scales[nonzero], ref.scales[nonzero]),
                     f"n={x.numel()}, B={B}: your scales differ from Δ_b = N_b / 127",
                     hint="Δ_b = max|block| / 127 in float32; an all-zero block needs some finite scale (not 0/0)")
            c.expect(torch.equal(codes, ref.codes), f"n={x.numel()}, B={B}: your codes differ from round(x / Δ_b)",
                     hint="torch.round (half to even), clamp to [−127, 127], int8")
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
            c.expect(bound.numel() == nb and torch.allclose(bound.double(), want.double(), rtol=1e-6, atol=0),
                     f"n={x.numel()}, B={B}: your bound per block is not N_b / 254",
                     hint="nearest rounding errs by at most half a step: Δ_b / 2 = N_b / 254")
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
