"""Checks for Lab 12: the online-softmax merge of two partial attention results, and attention block by block.

A partial result of queries Q against a block of keys K_j, V_j is the triple, per query row,

    m = rowmax S        ℓ = rowsum e^(S − m)        o = e^(S − m)·V_j        (S = Q·K_jᵀ/√d_h, causally masked)

(`partial_attention`; a row that sees no key of the block has m = −∞, ℓ = 0, o = 0). Merging two of them must give
exactly the triple of the union of their keys (Milakov & Gimelshein, arXiv 1805.02867; docs/formulas.md §11):

    m' = max(m₁, m₂)     ℓ' = ℓ₁·e^(m₁−m') + ℓ₂·e^(m₂−m')     o' = o₁·e^(m₁−m') + o₂·e^(m₂−m')     attention = o'/ℓ'

    check_merge(merge)                    merge(partial(A), partial(B)) = partial(A ∪ B), triple by triple, in float64,
                                          fully-masked rows and blocks included; each wrong triple named by its cause
    check_blockwise(blockwise_attention)  equals reference_attention to 1e-12, forward and backward, for several
                                          block sizes
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
    nan = [name for name, t in (("o", o), ("m", m), ("ℓ", l)) if bool(torch.isnan(t).any())]
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


def check_blockwise(blockwise_attention) -> None:
    with check("blockwise") as c:
        T = 16
        q, k, v, d_out = (_rand(B, NH, T, HS, seed=20 + i) for i in range(4))
        ref = [t.clone().requires_grad_() for t in (q, k, v)]
        want = C.reference_attention(*ref)
        want.backward(d_out)
        for block in (1, 3, 4, T):
            mine = [t.clone().requires_grad_() for t in (q, k, v)]
            out = blockwise_attention(*mine, block)
            c.expect(isinstance(out, torch.Tensor) and out.shape == want.shape,
                     f"block={block}: returned {getattr(out, 'shape', type(out).__name__)}, expected {tuple(want.shape)}",
                     hint="return o / ℓ after the last block: (B, nh, T, hs)")
            c.expect(not bool(torch.isnan(out).any()), f"block={block}: NaN in the output",
                     hint="the merge must handle blocks a row cannot see (m = −∞); run check_merge")
            err = (out - want).abs().max().item()
            c.expect(err < TOL, f"block={block}: max |Δ| = {err:.2e} from reference_attention",
                     hint="start from (o, m, ℓ) = (0, −∞, 0), merge every key block's partial_attention (with its "
                          "causal mask by global position), divide o by ℓ once at the end")
            out.backward(d_out)
            gerr = max((a.grad - b.grad).abs().max().item() for a, b in zip(mine, ref))
            c.expect(gerr < 1e-10, f"block={block}: gradients differ by {gerr:.2e}",
                     hint="use differentiable torch operations only (no .item(), no in-place on q, k, v)")
        c.passed(f"blocks of 1, 3, 4 and {T} keys: max |Δ| < 1e-12 from reference_attention, forward and backward")


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
