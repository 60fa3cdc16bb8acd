"""Checks for Lab 12: the online-softmax merge of two partial attention results, and attention block by block.

A partial result of queries Q against a block of keys K_j, V_j is the triple, per query row,

    m = rowmax S        ℓ = rowsum e^(S − m)        o = e^(S − m)·V_j        (S = Q·K_jᵀ/√d_h, causally masked)

(`partial_attention`; a row that sees no key of the block has m = −∞, ℓ = 0, o = 0). Merging two of them must give
exactly the triple of the union of their keys (Milakov & Gimelshein, arXiv 1805.02867; docs/formulas.md §11):

    m' = max(m₁, m₂)     ℓ' = ℓ₁·e^(m₁−m') + ℓ₂·e^(m₂−m')     o' = o₁·e^(m₁−m') + o₂·e^(m₂−m')     attention = o'/ℓ'

    check_merge(merge)                    merge(partial(A), partial(B)) = partial(A ∪ B), triple by triple, in float64,
                                          fully-masked rows and blocks included; each wrong triple named by its cause
    check_blockwise(blockwise_attention)  equals reference_attention to 1e-12, forward and backward, for several
                                          block sizes, and on scores all below −745 (e^S underflows to 0 in
                                          float64: a running max started at 0 gives 0/0); a wrong output is
                                          matched against what each plausible slip computes and named
    check_ring(merge, world_size)         your merge inside a ring over real ranks (zig-zag split, K/V passed
                                          around): equals reference_attention, bytes from the ledger =
                                          ring_bytes_per_layer's forward, exactly
"""
from __future__ import annotations

import math

import torch

from ..parallel import context as C
from . import NOT_IMPLEMENTED, check, exercises, run_ranks

TOL = 1e-12
B, NH, HS = 2, 2, 4

exercises({"merge": "Exercise 1 (the merge)", "blockwise_attention": "Exercise 2 (attention block by block)"})


def partial_attention(q, k, v, visible):
    """The triple (o, m, ℓ) of queries q (…, n, hs) against keys/values k, v (…, n_k, hs); visible (n, n_k) bool is
    the causal mask. Rows that see no key get m = −∞, ℓ = 0, o = 0."""
    s = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])                # (…, n, n_k)
    s = s.masked_fill(~visible, float("-inf"))
    m = s.amax(-1, keepdim=True)                                          # (…, n, 1)
    e = torch.exp(s - torch.where(torch.isinf(m), torch.zeros_like(m), m))
    return e @ v, m, e.sum(-1, keepdim=True)


def _rand(*shape, seed, scale=1.0):
    return scale * torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def _close(a, b) -> bool:
    return a.shape == b.shape and bool(torch.allclose(a, b, rtol=1e-10, atol=1e-12, equal_nan=False))


def _diagnose(c, got, want, parts) -> None:
    """One failure line naming the cause of a wrong merged triple."""
    (o1, m1, l1), (o2, m2, l2) = parts
    o, m, l = got
    ow, mw, lw = want
    c.expect(isinstance(got, tuple) and len(got) == 3, "merge must return the triple (o, m, ℓ)")
    c.expect(all(t.shape == w.shape for t, w in zip(got, want)),
             f"shapes {[tuple(t.shape) for t in got]}, expected {[tuple(t.shape) for t in want]}",
             hint="keep m and ℓ as (…, n, 1) columns, o as (…, n, hs)")
    both = ~torch.isinf(m1) & ~torch.isinf(m2)          # rows that see keys in both parts: every factor is finite
    if both.any():
        flipped = l1 * torch.exp(mw - m1) + l2 * torch.exp(mw - m2)
        c.expect(not (_close(l[both], flipped[both]) and not _close(flipped[both], lw[both])),
                 "ℓ' = ℓ₁·e^(m'−m₁) + ℓ₂·e^(m'−m₂): the rescale factors' sign is flipped (each part grows instead of "
                 "shrinking to the new max)", hint="scale by e^(m₁ − m') and e^(m₂ − m'): both are ≤ 1")
    nan_rows = sum(torch.isnan(t).any(-1, keepdim=True) for t in (o, m, l)).bool()
    nan = [name for name, t in (("o", o), ("m", m), ("ℓ", l)) if bool(torch.isnan(t).any())]
    c.expect(not (nan_rows & ~torch.isinf(mw)).any(),
             f"NaN in the merged {', '.join(nan)} for rows that see keys in one part only (the other's m = −∞)",
             hint="the part that saw no key has o = 0, ℓ = 0 and factor e^(−∞ − m') = 0: NaN there is ∞·0, from a "
                  "factor e^(m' − m) or a division by ℓ or e^m")
    c.expect(not nan, f"NaN in the merged {', '.join(nan)} for rows that see no key in either part (m₁ = m₂ = −∞)",
             hint="e^(m−m') with m = m' = −∞ is e^(NaN): where the new max is −∞, subtract 0 instead (the row stays "
                  "o = 0, ℓ = 0, m = −∞)")
    finite = ~torch.isinf(mw)
    c.expect(_close(m, mw), "the merged m is not max(m₁, m₂)", hint="m' = torch.maximum(m₁, m₂)")
    if not _close(l, lw):
        c.expect(not _close(l, l1 + l2), "ℓ' = ℓ₁ + ℓ₂: the two sums are relative to different maxima",
                 hint="rescale each ℓ by e^(m−m') before adding them")
        c.expect(not _close(torch.where(finite, l * torch.exp(-mw), lw), lw),
                 "ℓ' is e^(m') times too large: the exponentials were taken without subtracting the new max",
                 hint="scale by e^(m₁ − m') and e^(m₂ − m'), not by e^(m₁) and e^(m₂) (which also overflows)")
        c.expect(False, f"ℓ' is off by up to {(l - lw).abs().max().item():.2e}",
                 hint="ℓ' = ℓ₁·e^(m₁−m') + ℓ₂·e^(m₂−m')")
    if not _close(o, ow):
        c.expect(not _close(o, torch.where(finite, ow / lw.clamp_min(1e-300), ow)),
                 "o' is already divided by ℓ': the final o/ℓ would normalise twice",
                 hint="keep o unnormalised in the merge; divide by ℓ once, after the last block")
        c.expect(not _close(o, o1 + o2), "o' = o₁ + o₂: the two partial outputs are relative to different maxima",
                 hint="rescale o by e^(m−m') too, exactly as ℓ")
        c.expect(False, f"o' is off by up to {(o - ow).abs().max().item():.2e}",
                 hint="o' = o₁·e^(m₁−m') + o₂·e^(m₂−m')")


def check_merge(merge) -> None:
    with check("merge") as c:
        T, n1 = 12, 5
        pos = torch.arange(T)
        cases = 0
        for seed, scale, shift in ((0, 1.0, 0), (1, 30.0, 0), (2, 1.0, 7)):
            q, k, v = (_rand(B, NH, T, HS, seed=10 * seed + i, scale=scale if i < 2 else 1.0) for i in range(3))
            # keys split in two parts; queries shifted so that early rows see no key of either part (shift > 0)
            vis = pos[:, None] >= pos[None, :] + shift
            a = (slice(0, n1), slice(n1, T))
            parts = [partial_attention(q, k[..., s, :], v[..., s, :], vis[:, s]) for s in a]
            want = partial_attention(q, k, v, vis)
            got = merge(parts[0], parts[1])
            _diagnose(c, got, want, parts)
            swapped = merge(parts[1], parts[0])
            c.expect(all(_close(x, y) or torch.equal(x, y) for x, y in zip(swapped, want)),
                     "merge(b, a) differs from merge(a, b)", hint="the merge is symmetric in its two parts")
            cases += 1
        c.passed(f"{cases} cases (scores up to ×30, rows fully masked in both parts): the merged (o, m, ℓ) equals "
                 f"the triple of all keys at once")


def _attention(q, k, v, visible):
    """o/ℓ of all keys at once under the mask `visible` (T, T): NaN in rows that see no key."""
    o, _, l = partial_attention(q, k, v, visible)
    return o / l


def _blockwise_cause(outs, q, k, v):
    """The (message, hint) naming what a wrong blockwise output computes, or None when no plausible slip explains
    it. `outs` maps each block size to its output; a slip explains them when it matches at every block size (a
    slip that has no effect at some block size computes the right answer there)."""
    T = q.shape[-2]
    t, s = torch.arange(T)[:, None], torch.arange(T)[None, :]
    causal = t >= s
    o, m, l = partial_attention(q, k, v, causal)
    same = {b: (lambda want, out=out: out.shape == want.shape and bool(
        torch.allclose(out, want, rtol=1e-10, atol=1e-12, equal_nan=True))) for b, out in outs.items()}
    slips = [
        (lambda b: _attention(q, k, v, t > s),
         "it is attention with each query's own key hidden (t > s): the causal mask is off by one, and row 0 sees "
         "no key (0/0)", "a query sees every key at or before its position: visible[t, s] = t ≥ s"),
        (lambda b: _attention(q, k, v, t <= s),
         "it is attention with the mask reversed: each query sees the keys at or after it",
         "a query sees the keys at or before its position: visible[t, s] = t ≥ s"),
        (lambda b: _attention(q, k, v, torch.ones(T, T, dtype=torch.bool)),
         "it is attention without the causal mask: each query sees the keys after it",
         "pass each block's partial_attention the mask visible[t, s] = t ≥ s, by global position"),
        (lambda b: _attention(q, k, v, t >= s % b),
         "it is attention with each block's mask built from the keys' positions inside the block (0 … block−1), "
         "not in the sequence", "compare global positions: the block's keys are pos[start:start + block]"),
        (lambda b: o, "it is o before the division: the output was not divided by ℓ",
         "divide o by ℓ once, after the last block"),
        (lambda b: o / m, "it is o/m: the output was divided by the running max, not by ℓ",
         "the triple is (o, m, ℓ): attention is o/ℓ"),
    ]
    for want, message, hint in slips:
        if all(same[b](want(b)) for b in outs):
            return message, hint
    skipped = {}
    for b in outs:
        if not same[b](_attention(q, k, v, causal)):
            n = next((n for n in range(T) if same[b](_attention(q, k, v, causal & (s < n)))), None)
            if n is None:
                return None
            skipped[b] = n
    return ("it is attention over the first keys only: " + "; ".join(
        f"with blocks of {b}, key{f's {n} …' if n < T - 1 else ''} {T - 1} never merged" for b, n in skipped.items()),
        "loop over range(0, T, block): the last block may be shorter than the others")


def _low_scores(q, k):
    """q, k moved so that every score is below −745, where e^S underflows to 0 in float64 (only e^(S − rowmax) is
    safe there): q + 25, k − 25 (scaled by 0.1 first) give scores ≈ −2·25² = −1250 within a few tens. Returns the
    pair and the largest score."""
    low = 25.0 * torch.ones(HS, dtype=torch.float64)
    ql, kl = q * 0.1 + low, k * 0.1 - low
    top = ((ql @ kl.transpose(-2, -1)) / math.sqrt(HS)).max().item()
    if not top < -745:
        raise RuntimeError(f"lab12's low-score input has a score of {top:.0f}: it must stay below −745 (a bug in the "
                           f"check)")
    return ql, kl, top


def check_blockwise(blockwise_attention) -> None:
    with check("blockwise") as c:
        T, blocks = 16, (1, 3, 4, 16)
        q, k, v, d_out = (_rand(B, NH, T, HS, seed=20 + i) for i in range(4))
        ref = [t.clone().requires_grad_() for t in (q, k, v)]
        want = C.reference_attention(*ref)
        want.backward(d_out)
        mine, outs = {}, {}
        for block in blocks:
            mine[block] = [t.clone().requires_grad_() for t in (q, k, v)]
            out = blockwise_attention(*mine[block], block)
            c.expect(isinstance(out, torch.Tensor) and out.shape == want.shape,
                     f"block={block}: returned {getattr(out, 'shape', type(out).__name__)}, "
                     f"expected {tuple(want.shape)}",
                     hint="return o / ℓ after the last block: (B, nh, T, hs)")
            outs[block] = out
        want = want.detach()
        wrong = [b for b in blocks if not (outs[b].detach() - want).abs().max().item() < TOL]   # NaN is wrong too
        if wrong:
            cause = _blockwise_cause({b: o.detach() for b, o in outs.items()}, q, k, v)
            if cause is not None:
                c.expect(False, f"blocks of {', '.join(map(str, wrong))} keys: the output is wrong — {cause[0]}",
                         hint=cause[1])
            b = wrong[0]
            err = (outs[b].detach() - want).abs().max().item()
            c.expect(False, f"block={b}: " + ("NaN in the output" if err != err else
                                              f"max |Δ| = {err:.2e} from reference_attention"),
                     hint="run check_merge first (it names a wrong merge); then start from (o, m, ℓ) = (0, −∞, 0), "
                          "merge every key block's partial_attention (with its causal mask by global position), "
                          "divide o by ℓ once at the end")
        for block in blocks:
            outs[block].backward(d_out)
            gerr = max((a.grad - b.grad).abs().max().item() for a, b in zip(mine[block], ref))
            c.expect(gerr < 1e-10, f"block={block}: gradients differ by {gerr:.2e}",
                     hint="use differentiable torch operations only (no .item(), no in-place on q, k, v)")
        ql, kl, top = _low_scores(q, k)
        want = C.reference_attention(ql, kl, v)
        for block in blocks:
            out = blockwise_attention(ql, kl, v, block)
            c.expect(not bool(torch.isnan(out).any()),
                     f"block={block}: NaN in the output when every score is below −745 (−{-top:.0f} at most; e^S "
                     f"underflows to 0 in float64), though N(0, 1) scores pass: the running max started at 0 (or "
                     f"another finite value) instead of −∞, so o = ℓ = 0 and o/ℓ = 0/0",
                     hint="start from m = −∞ (torch.full(…, float('-inf'))): the first block's max then replaces it "
                          "and e^(S − m) never underflows for the row's largest score")
            err = (out - want).abs().max().item()
            c.expect(err < TOL, f"block={block}: max |Δ| = {err:.2e} from reference_attention when every score is "
                                f"below −745", hint="subtract the running max before every exponential")
        c.passed(f"blocks of 1, 3, 4 and {T} keys: max |Δ| < 1e-12 from reference_attention, forward and backward, "
                 f"and with every score below −745")


def _ring_worker(ctx, merge, T):
    """Forward ring attention with the learner's merge: the library's ring transfer (`rotate`), zig-zag split."""
    comm, r, cp = ctx.comm, ctx.rank, ctx.world_size
    q, k, v = (_rand(B, NH, T, HS, seed=40 + i) for i in range(3))
    all_pos = [C.positions(T, cp, j) for j in range(cp)]
    mine = [C.shard(t, cp, r, dim=2) for t in (q, k, v)]
    acc = (torch.zeros_like(mine[0]), torch.full(mine[0].shape[:-1] + (1,), float("-inf"), dtype=torch.float64),
           torch.zeros(mine[0].shape[:-1] + (1,), dtype=torch.float64))
    kv = (mine[1], mine[2])
    comm.ledger.reset()
    try:
        for s in range(cp):
            pending = C.rotate(comm, kv, "lab12:kv") if s < cp - 1 else None
            j = (r - s) % cp
            visible = all_pos[r][:, None] >= all_pos[j][None, :]
            acc = merge(acc, partial_attention(mine[0], kv[0], kv[1], visible))
            if pending is not None:
                kv = pending.wait()
    except NotImplementedError:
        if pending is not None:                  # let the neighbours' transfers complete
            pending.wait()
        return NOT_IMPLEMENTED
    out = acc[0] / acc[2]
    want = C.shard(C.reference_attention(q, k, v), cp, r, dim=2)
    return {"err": (out - want).abs().max().item(), "nan": bool(torch.isnan(out).any()),
            "bytes": comm.ledger.bytes_sent()}


def check_ring(merge, world_size: int = 4) -> None:
    if world_size not in (2, 3, 4):
        raise ValueError(f"world_size={world_size}: the ring check runs on 2 to 4 ranks")
    with check("ring") as c:
        T = 8 * world_size
        res = run_ranks(c, _ring_worker, world_size, merge, T, timeout=60,
                        hang_hint="merge must not communicate: the check moves K/V around the ring for you")
        want = C.ring_bytes_per_layer(B, T, NH * HS, world_size, 8)["forward"]
        for rank, r in enumerate(res):
            c.expect(not r["nan"], f"rank {rank}: NaN in the output",
                     hint="some blocks are invisible to some rows (m = −∞): handle them in the merge")
            c.expect(r["err"] < TOL, f"rank {rank}: max |Δ| = {r['err']:.2e} from reference_attention",
                     hint="run check_merge first: it names the cause")
            c.expect(r["bytes"] == want, f"rank {rank} sent {r['bytes']:,} B, the formula says {want:,} B",
                     hint="merge must not send anything itself")
        c.passed(f"{world_size} ranks, T = {T}: every rank's attention within 1e-12 of reference_attention; "
                 f"{want:,} B sent per rank = 2·(cp−1)·b·(T/cp)·d·8, from the ledger")


__all__ = ["partial_attention", "check_merge", "check_blockwise", "check_ring"]
