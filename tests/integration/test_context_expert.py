"""Context parallelism (ring attention) and expert parallelism (MoE over an all-to-all from send/recv) on real
ranks: equal to the single-process computation in float64, forward and backward, with the bytes of the formulas."""
import copy

import pytest
import torch
import torch.distributed as dist

from course_lib.core.moe import MoE, capacity, check_moe, route
from course_lib.distributed.all_to_all import all_to_all, all_to_all_bytes
from course_lib.distributed.launch import launch
from course_lib.parallel import context as C
from course_lib.parallel.expert import ExpertParallelMoE, expert_bytes_per_forward

pytestmark = pytest.mark.integration


# ------------------------------------------------------------------------------------------ ring attention
def _ring(ctx, T, layouts, seed):
    torch.manual_seed(seed)
    B, nh, hs = 2, 2, 4
    q, k, v, d_out = (torch.randn(B, nh, T, hs, dtype=torch.float64) for _ in range(4))
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    C.reference_attention(*ref).backward(d_out)
    cp, r = ctx.world_size, ctx.rank
    out = {}
    for layout in layouts:
        mine = [C.shard(t, cp, r, layout, dim=2).clone().requires_grad_() for t in (q, k, v)]
        ctx.comm.ledger.reset()
        y = C.ring_attention(*mine, ctx.comm, seq_len=T, layout=layout)
        fwd = ctx.comm.ledger.bytes_sent()
        y.backward(C.shard(d_out, cp, r, layout, dim=2))
        want = C.shard(C.reference_attention(q, k, v), cp, r, layout, 2)
        errs = [(y - want).abs().max().item()] + [(a.grad - C.shard(b.grad, cp, r, layout, 2)).abs().max().item()
                                                  for a, b in zip(mine, ref)]
        out[layout] = {"err": max(errs), "fwd": fwd, "bwd": ctx.comm.ledger.bytes_sent() - fwd}
        ag = [C.shard(t, cp, r, layout, dim=2).clone().requires_grad_() for t in (q, k, v)]
        ctx.comm.ledger.reset()
        y = C.allgather_attention(*ag, ctx.comm, seq_len=T, layout=layout)
        fwd = ctx.comm.ledger.bytes_sent()
        y.backward(C.shard(d_out, cp, r, layout, dim=2))
        errs = [(y - want).abs().max().item()] + [(a.grad - C.shard(b.grad, cp, r, layout, 2)).abs().max().item()
                                                  for a, b in zip(ag, ref)]
        out[layout + "/allgather"] = {"err": max(errs), "fwd": fwd, "bwd": ctx.comm.ledger.bytes_sent() - fwd}
    mine = [C.shard(t, cp, r, dim=2).clone().requires_grad_() for t in (q, k, v)]
    ctx.comm.ledger.reset()
    with C.block_spans(ctx.comm):                  # ring attention logs each step's block computation itself
        C.ring_attention(*mine, ctx.comm, seq_len=T).backward(C.shard(d_out, cp, r, dim=2))
    out["events"] = [(e.kind, e.op, e.tag, e.t0, e.t1) for e in ctx.comm.ledger.events]
    return out


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_ring_attention_equals_one_process_forward_and_backward_with_the_ring_bytes(cp):
    T = 24
    res = launch(_ring, cp, T, C.LAYOUTS, cp, timeout=120)
    want = C.ring_bytes_per_layer(2, T, 2 * 4, cp, 8)
    gathered = C.allgather_bytes_per_layer(2, T, 2 * 4, cp, 8)
    for r in res:
        for layout in C.LAYOUTS:
            assert r[layout]["err"] < 1e-12, (layout, r[layout]["err"])
            assert (r[layout]["fwd"], r[layout]["bwd"]) == (want["forward"], want["backward"])
            ag = r[layout + "/allgather"]                 # Llama 3's all-gathered K/V: the same result, fewer bytes
            assert ag["err"] < 1e-12 and (ag["fwd"], ag["bwd"]) == (gathered["forward"], gathered["backward"])


@pytest.mark.parametrize("cp", [2, 3])
def test_ring_attention_posts_each_next_kv_block_before_computing_forward_and_backward(cp):
    """The overlap by construction (an order, not a timing): every K/V send of the ring, forward ('cp:kv') and
    backward ('cp:kv.bwd'), is posted inside the block-computation span of the step that holds the block, and each
    pass logs one span per ring step; dK, dV ('cp:dkv.bwd') follow after the span that updated them."""
    for r in launch(_ring, cp, 24, (), cp, timeout=120):
        spans = [(t0, t1) for kind, _, tag, t0, t1 in r["events"] if kind == "compute" and tag == "block"]
        assert len(spans) == 2 * cp                              # cp steps forward, cp steps backward
        for tag in ("cp:kv", "cp:kv.bwd"):
            posted = [t0 for kind, op, tg, t0, _ in r["events"] if op == "send" and tg == tag]
            assert len(posted) == 2 * (cp - 1), tag              # K and V, cp − 1 hops
            assert all(any(a <= t <= b for a, b in spans) for t in posted), tag
        follow = [t0 for _, op, tg, t0, _ in r["events"] if op == "send" and tg == "cp:dkv.bwd"]
        assert len(follow) == 2 * cp and not any(a <= t <= b for a, b in spans for t in follow)


def test_the_zigzag_split_gives_every_rank_the_same_causal_work():
    T, cp = 64, 4
    contiguous = [C.visible_pairs(T, cp, r, "contiguous") for r in range(cp)]
    zigzag = [C.visible_pairs(T, cp, r, "zigzag") for r in range(cp)]
    assert sum(contiguous) == sum(zigzag) == T * (T + 1) // 2
    n, c = T // cp, T // (2 * cp)
    assert contiguous == [n * r * n + n * (n + 1) // 2 for r in range(cp)]          # rank 3: 49+…+64, rank 0: 1+…+16
    assert zigzag == [(2 * cp - 1) * c * c + c * (c + 1)] * cp                    # one early + one late chunk each
    for layout in C.LAYOUTS:
        parts = [C.shard(torch.arange(T)[None], cp, r, layout) for r in range(cp)]
        assert torch.equal(C.unshard(parts, T, layout), torch.arange(T)[None])


def test_a_sequence_the_split_cannot_cut_is_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"T=20 is not a multiple of 8"):
        C.check_cp(20, 4, "zigzag")


# ------------------------------------------------------------------------------------------ experts
def _ep(ctx, cases):
    out = []
    for E, k, cf in cases:
        torch.manual_seed(E + k)
        P, r, b, T, d = ctx.world_size, ctx.rank, 2, 8, 16
        ref = MoE(d, E, top_k=k, capacity_factor=cf, groups=P).double()
        x, w = (torch.randn(P * b, T, d, dtype=torch.float64) for _ in range(2))
        xr = x.clone().requires_grad_()
        (ref(xr) * w).sum().backward()
        routing = ref.last[r]
        stats = {"counts": routing.counts.tolist(), "dropped": routing.dropped, "C": routing.capacity}
        ref.last = []
        mine = ExpertParallelMoE(copy.deepcopy(ref), ctx.comm)
        mine.zero_grad(set_to_none=True)
        xl = x[r * b:(r + 1) * b].clone().requires_grad_()
        ctx.comm.ledger.reset()
        y = mine(xl)
        fwd = ctx.comm.ledger.bytes_sent()
        (y * w[r * b:(r + 1) * b]).sum().backward()
        refp = dict(ref.named_parameters())
        router = mine.router.weight.grad.clone()
        dist.all_reduce(router)                     # the replicated router's gradient: a partial sum per rank
        errs = [(y - ref(x)[r * b:(r + 1) * b]).abs().max().item(),
                (xl.grad - xr.grad[r * b:(r + 1) * b]).abs().max().item(),
                (router - ref.router.weight.grad).abs().max().item()]
        errs += [(p.grad - refp[n].grad).abs().max().item() for n, p in mine.named_parameters() if "experts" in n]
        out.append({"err": max(errs), "fwd": fwd, "bwd": ctx.comm.ledger.bytes_sent() - fwd,
                    "sent": mine.sent_rows[0], "stats": stats, "local": mine.local,
                    "experts": sorted({int(n.split(".")[1]) for n, _ in mine.named_parameters() if "experts" in n})})
    return out


CASES = [(4, 1, 1.0), (4, 2, 0.5), (8, 2, 1.25), (4, 4, 2.0)]


@pytest.mark.parametrize("ep", [2, 4])
def test_expert_parallel_moe_equals_one_process_for_any_routing_and_sends_the_routed_tokens(ep):
    cases = [c for c in CASES if c[0] % ep == 0]
    res = launch(_ep, ep, cases, timeout=120)
    for i, (E, k, cf) in enumerate(cases):
        rows = [r[i]["sent"] for r in res]                        # rows[src][dst]
        for rank, r in enumerate(res):
            c = r[i]
            assert c["err"] < 1e-12, (E, k, cf, c["err"])
            assert c["experts"] == list(range(rank * E // ep, (rank + 1) * E // ep))
            # every kept assignment travels: the counts the router reported, nothing more
            assert sum(c["sent"]) == sum(c["stats"]["counts"]) == 2 * 8 * k - c["stats"]["dropped"]
            assert max(c["stats"]["counts"]) <= c["stats"]["C"] == capacity(16, E, k, cf)
            want = expert_bytes_per_forward(rows[rank], [rows[j][rank] for j in range(ep)], rank, 16, 8, E // ep)
            assert c["fwd"] == sum(want.values())
            assert c["bwd"] == want["dispatch"] + want["combine"]        # the gradients retrace the same rows
    assert any(r[1]["stats"]["dropped"] for r in res)                  # capacity 0.5 overflowed: dropped tokens


def _a2a(ctx):
    P, r = ctx.world_size, ctx.rank
    pieces = [torch.full((j + r + 1, 3), float(10 * r + j)) for j in range(P)]     # uneven splits
    ctx.comm.ledger.reset()
    mine = all_to_all(ctx.comm, pieces, out_sizes=[r + i + 1 for i in range(P)])
    sent = ctx.comm.ledger.bytes_sent()
    inp = torch.cat(pieces)
    out = torch.empty(sum(r + i + 1 for i in range(P)), 3)
    dist.all_to_all_single(out, inp, [r + j + 1 for j in range(P)], [r + i + 1 for i in range(P)])
    return torch.equal(torch.cat(mine), out), sent, [p.shape[0] for p in pieces]


def test_all_to_all_from_send_recv_equals_torch_all_to_all_single_with_uneven_splits():
    for rank, (same, sent, rows) in enumerate(launch(_a2a, 3, timeout=60)):
        assert same and sent == all_to_all_bytes(rows, rank, 3, 4)


def test_bad_moe_settings_are_refused_before_any_rank_waits():
    for args, match in (((4, 5, 1.0), "top_k=5 must be between 1 and n_expert=4"),
                        ((4, 1, 0.0), "capacity_factor must be > 0"), ((0, 1, 1.0), "n_expert")):
        with pytest.raises(ValueError, match=match):
            check_moe(*args)
    with pytest.raises(ValueError, match="n_expert=6 does not split over ep=4"):
        class Solo:
            world_size, rank = 4, 0
        ExpertParallelMoE(MoE(8, 6), Solo())
    r = route(torch.zeros(10, 4), 1, 1.0)      # equal logits: P_e = 1/E, so the aux loss reads its minimum, 1,
    assert abs(r.aux.item() - 1.0) < 1e-12    # though top-1 sends every token to the same expert
    assert sorted(r.counts.tolist()) == [0, 0, 0, r.capacity] and r.dropped == 10 - r.capacity


# ------------------------------------------------------------------------------------------ the GPT under cp × dp
def _cp_gpt(ctx, cfg, tc, dp, cp, layout):
    from course_lib import optim
    from course_lib.core.model import GPT
    from course_lib.distributed.mesh import Mesh
    from course_lib.parallel.context import apply_cp
    from course_lib.parallel.dp import apply_dp
    from course_lib.train import LedgerProbe, optimizer_kwargs, run
    mesh = Mesh(ctx.comm, dp=dp, cp=cp)
    model = apply_cp(GPT(cfg, seed=tc.seed).double(), mesh, layout=layout)
    model = apply_dp(model, mesh.group("dp", "cp"))
    ctx.comm.ledger.reset()
    r = run(model, optim.build(model, **optimizer_kwargs(tc)), mesh.batches(cfg.seq_len, tc.batch_size // dp,
                                                                      seed=tc.data_seed),
            steps=tc.steps, keep_params=True, probes=[LedgerProbe(ctx.comm, groups=("cp",))])
    return {"losses": r.losses, "params": r.params, "cp_bytes": [g["cp"] for g in r["ledger"]["group_bytes"]]}


@pytest.mark.parametrize("dp, cp, layout", [(1, 2, "zigzag"), (2, 2, "zigzag"), (1, 4, "contiguous")])
def test_the_gpt_under_context_parallelism_trains_like_one_process(dp, cp, layout):
    from course_lib.core.model import GPT, get_config
    from course_lib.train import TrainConfig, train_reference
    cfg, tc = get_config("nano", seq_len=16), TrainConfig(steps=2, batch_size=4, lr=1e-2)
    ref = train_reference(cfg, tc, progress=False, model=GPT(cfg, seed=tc.seed).double())
    res = launch(_cp_gpt, dp * cp, cfg, tc, dp, cp, layout, timeout=180)
    want = dict(ref.model.named_parameters())
    per_step = cfg.n_layer * sum(C.ring_bytes_per_layer(tc.batch_size // dp, cfg.seq_len, cfg.d_model, cp, 8).values())
    for r in res:
        assert max((v - want[k]).abs().max().item() for k, v in r["params"].items()) < 1e-12
        assert r["cp_bytes"] == [per_step] * tc.steps
    for s in range(tc.steps):                  # the mean of the cp ranks' token means is the mean over all T
        assert abs(sum(r["losses"][s] for r in res) / len(res) - ref.losses[s]) < 1e-12


# ------------------------------------------------------------------------------------------ the MoE GPT under ep × dp
def _ep_gpt(ctx, cfg, tc, dp, ep):
    from course_lib import optim
    from course_lib.core.model import GPT
    from course_lib.distributed.mesh import Mesh
    from course_lib.parallel.expert import ExpertDataParallel, apply_ep, is_expert_param
    from course_lib.train import optimizer_kwargs, run
    mesh = Mesh(ctx.comm, dp=dp, ep=ep)
    model = GPT(cfg, seed=tc.seed).double()
    if ep > 1:
        apply_ep(model, mesh)
    wrapped = ExpertDataParallel(model, mesh)
    r = run(wrapped, optim.build(model, **optimizer_kwargs(tc)), mesh.batches(cfg.seq_len, tc.batch_size // dp,
                                                                        seed=tc.data_seed),
            steps=tc.steps, keep_params=True)
    experts = sum(p.numel() for n, p in model.named_parameters() if is_expert_param(n))
    return {"losses": r.losses, "params": r.params, "expert_params": experts}


@pytest.mark.parametrize("dp, ep", [(2, 2), (4, 2), (4, 4)])
def test_the_moe_gpt_under_expert_parallelism_trains_like_one_process(dp, ep):
    from course_lib.core.model import GPT, get_config
    from course_lib.core.moe import expert_param_count
    from course_lib.parallel.expert import set_moe_groups
    from course_lib.train import TrainConfig, train_reference
    cfg = get_config("nano", seq_len=16, n_expert=4, top_k=2, capacity_factor=1.0)
    tc = TrainConfig(steps=2, batch_size=dp * 2, lr=1e-2)
    ref_model = GPT(cfg, seed=tc.seed).double()
    set_moe_groups(ref_model, dp)                 # capacity per rank's micro-batch, as the ranks decide it
    ref = train_reference(cfg, tc, progress=False, model=ref_model)
    res = launch(_ep_gpt, dp, cfg, tc, dp, ep, timeout=180)
    want = dict(ref.model.named_parameters())
    for r in res:
        assert max((v - want[k]).abs().max().item() for k, v in r["params"].items()) < 1e-12
        # each rank holds E/ep experts of every layer
        assert r["expert_params"] == cfg.n_layer * expert_param_count(cfg.d_model, cfg.n_expert // ep)
    for s in range(tc.steps):
        assert abs(sum(r["losses"][s] for r in res) / dp - ref.losses[s]) < 1e-12
