"""Checks for Lab 04: ZeRO-2 by hand, with FSDP2's layout (every parameter sharded on its own, uneven chunks).

    check_adamw(adamw_step_)              3 steps of your AdamW update == torch.optim.AdamW: m, v, then the parameter;
                                          a wrong parameter is matched against the usual mistakes (no bias
                                          correction, L2 instead of decoupled decay, …) to name the cause
    check_zero2_numerics(Zero2, n)        float64, every rank, every step, in the order the algorithm computes them:
                                          the averaged gradient chunks (== the reference gradient's chunk r), the
                                          moments m and v of the chunk, the updated chunk, the all-gathered full
                                          parameters, the loss — so a failure names the first quantity that is off
    check_zero2_memory(Zero2, n)          fp32, after a step: 4Ψ parameters, only my gradient chunks (4·Σ chunk),
                                          m and v for them only (8·Σ chunk) — exact, per rank, from the accountant
    check_zero2_traffic(Zero2, n)         fp32 ledger bytes per rank = Σ over parameters of a ring reduce-scatter and a
                                          ring all-gather (exact); over all ranks, DDP's 2(N−1)·4Ψ
                                          (docs/formulas.md §2.1)

The learner's `Zero2` is trained by the course's loop (`train.run`), like every optimizer of the course. Numerics
run in float64, where data parallelism only reorders additions and agrees with one process to ~1e-12 whatever the
seed; memory and bytes are counted in fp32, the dtype the formulas are written for.
"""
from __future__ import annotations

import torch

from .. import optim
from ..core.data import ShardedBatches
from ..core.model import GPT, get_config
from ..distributed.collectives import chunk_sizes, ring_all_gather_bytes, ring_reduce_scatter_bytes
from ..distributed.launch import LaunchError, launch
from ..distributed.mesh import data_parallel_batches
from ..memory import untracked
from ..train import MemoryProbe, Probe, TrainConfig, optimizer_kwargs, run
from . import check

CFG = get_config("nano")
STEPS = 3
HPARAMS = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
TOL = 1e-10                 # float64: what is left after 3 steps is rounding of the summation order
_RUNS: dict = {}


# ------------------------------------------------------------------------------------------------- AdamW
def _adamw_variant(p, g, m, v, t, *, lr, betas, eps, weight_decay, variant="torch"):
    """One AdamW step in place on float64 tensors — torch's, or one of the usual mistakes (to name a failure)."""
    b1, b2 = betas
    if variant == "L2 weight decay":                     # Adam with L2: the decay goes into the gradient
        g = g + weight_decay * p
    elif variant != "no weight decay":
        p.mul_(1 - lr * weight_decay)
    m.mul_(b1).add_(g, alpha=1 - b1)
    v.mul_(b2).addcmul_(g, g, value=1 - b2)
    c1 = 1 if variant in ("no bias correction", "bias correction of v only") else 1 - b1 ** t
    c2 = 1 if variant in ("no bias correction", "bias correction of m only") else 1 - b2 ** t
    denom = ((v / c2 + eps ** 2).sqrt() if variant == "eps inside the square root" else (v / c2).sqrt() + eps)
    p.sub_(lr * (m / c1) / denom)


_VARIANT_HINTS = {
    "no bias correction": "your update uses m and v as they are: divide them by (1 − β₁ᵗ) and (1 − β₂ᵗ) first "
                          "(bias correction: both start at zero, so early steps would be too small)",
    "bias correction of m only": "you bias-corrected m but not v: use √(v / (1 − β₂ᵗ))",
    "bias correction of v only": "you bias-corrected v but not m: use m / (1 − β₁ᵗ)",
    "no weight decay": "the decoupled weight decay is missing: first p ← p·(1 − lr·weight_decay)",
    "L2 weight decay": "that is Adam with L2 regularization (decay added to the gradient); AdamW decays the "
                       "parameter itself: p ← p·(1 − lr·weight_decay), and m and v see the plain gradient",
    "eps inside the square root": "eps goes outside the square root: √(v̂) + eps",
}
_FORMULA = ("in place: p ← p·(1 − lr·wd); m ← β₁m + (1−β₁)g; v ← β₂v + (1−β₂)g²; "
            "p ← p − lr·(m / (1−β₁ᵗ)) / (√(v / (1−β₂ᵗ)) + eps), with t counting steps from 1")


def _name_mistake(p_before, g, m_before, v_before, t, p_got, m_got, v_got) -> str | None:
    """The hint of the usual mistake that reproduces a wrong step (parameter, m and v), or None."""
    for variant, hint in _VARIANT_HINTS.items():
        p, m, v = p_before.clone(), m_before.clone(), v_before.clone()
        _adamw_variant(p, g, m, v, t, variant=variant, **HPARAMS)
        if all((a - b.reshape(a.shape)).abs().max().item() <= 1e-12 * max(1.0, a.abs().max().item())
               for a, b in ((p, p_got), (m, m_got), (v, v_got))):
            return hint
    return None


def check_adamw(adamw_step_) -> None:
    with check("adamw") as c:
        g = torch.Generator().manual_seed(4)
        ref = torch.nn.Parameter(torch.randn(37, generator=g, dtype=torch.float64))
        opt = torch.optim.AdamW([ref], **HPARAMS)
        mine, m, v = ref.detach().clone(), torch.zeros(37, dtype=torch.float64), torch.zeros(37, dtype=torch.float64)
        for t in range(1, 4):
            grad = torch.randn(37, generator=g, dtype=torch.float64)
            before = (mine.clone(), grad, m.clone(), v.clone(), t)
            ref.grad = grad.clone()
            opt.step()
            adamw_step_(mine, grad, m, v, t, **HPARAMS)
            state = opt.state[ref]
            errs = {"exp_avg (m)": (m - state["exp_avg"]).abs().max().item(),
                    "exp_avg_sq (v)": (v - state["exp_avg_sq"]).abs().max().item(),
                    "parameter": (mine - ref.detach()).abs().max().item()}
            wrong = [k for k, e in errs.items() if not e < TOL]
            if wrong:
                named = _name_mistake(*before, mine, m, v)
                hints = {"exp_avg (m)": "m ← β₁·m + (1 − β₁)·g, in place on exp_avg (the raw moment: bias "
                                        "correction is applied only in the update, not stored)",
                         "exp_avg_sq (v)": "v ← β₂·v + (1 − β₂)·g² (the squared gradient), in place on exp_avg_sq",
                         "parameter": _FORMULA}
                c.expect(False, f"step {t}: your {' and '.join(wrong)} differ{'s' if len(wrong) == 1 else ''} from "
                                f"torch.optim.AdamW's by up to {max(errs[k] for k in wrong):.1e}"
                                + (" (m and v are right)" if wrong == ["parameter"] else ""),
                         hint=named or hints[wrong[0]])
        c.passed(f"3 steps equal torch.optim.AdamW: m, v and the parameter within {TOL:g} (float64)")


# ------------------------------------------------------------------------------------------------- ZeRO-2 runs
class _Zero2Probe(Probe):
    """After each step: label what the accountant cannot know (my gradient chunks, m and v) and record what the
    checks compare — the chunks, the moments, the parameters, any p.grad left behind."""
    name = "zero2"

    def __init__(self, z, model, comm, memory=None, capture=False):
        self.z, self.comm, self.memory, self.capture = z, comm, memory, capture
        self.named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.steps = []

    def after_step(self, step):
        z = self.z
        self.comm.release()                    # finished transfers would otherwise pin their buffers
        if self.memory is not None:
            tracker = self.memory.tracker
            tracker.track([g for g in z.grad_chunks if g is not None], "gradients")
            tracker.track(list(z.exp_avg) + list(z.exp_avg_sq), "optimizer")
        with untracked():
            rec = {"grads_left": [n for n, p in self.named if p.grad is not None]}
            if self.capture:
                rec.update(grad=[None if g is None else g.detach().clone() for g in z.grad_chunks],
                           m=[t.detach().clone() for t in z.exp_avg], v=[t.detach().clone() for t in z.exp_avg_sq],
                           params={n: p.detach().clone() for n, p in self.named})
        self.steps.append(rec)

    def finish(self):
        return self.steps


def _tc(world_size: int, seed: int) -> TrainConfig:
    return TrainConfig(steps=STEPS, batch_size=2 * world_size, seed=seed, data_seed=seed, **HPARAMS)


def _worker(ctx, Zero2, tc):
    out = {}
    for dtype in (torch.float64, torch.float32):
        model = GPT(CFG, seed=tc.seed).to(dtype)
        try:
            z = Zero2(model, ctx.comm, **HPARAMS)
        except NotImplementedError:
            return "not implemented"
        data = data_parallel_batches(ctx.comm, CFG.seq_len, tc.batch_size, seed=tc.data_seed)
        mem = MemoryProbe(timeline=False) if dtype == torch.float32 else None
        probe = _Zero2Probe(z, model, ctx.comm, memory=mem, capture=dtype == torch.float64)
        ctx.comm.ledger.reset()
        try:
            r = run(model, z, data, steps=tc.steps, probes=[probe] + ([mem] if mem else []))
        except NotImplementedError:
            return "not implemented"
        out[str(dtype).split(".")[-1]] = {"losses": r.losses, "steps": r["zero2"], "sent": ctx.comm.ledger.bytes_sent(),
                                          "after_step": r["memory"]["after_step"][-1] if mem else None}
    return out


class _RefProbe(Probe):
    """The reference's gradients (before zero_grad), AdamW's m and v and the parameters, after every step."""
    name = "ref"

    def __init__(self):
        self.steps = []

    def start(self, model, optimizer):
        self.model, self.opt = model, optimizer

    def after_step(self, step):
        named = list(self.model.named_parameters())
        self.steps.append({"grad": [p.grad.detach().clone() for _, p in named],
                           "m": [self.opt.state[p]["exp_avg"].clone() for _, p in named],
                           "v": [self.opt.state[p]["exp_avg_sq"].clone() for _, p in named],
                           "params": {n: p.detach().clone() for n, p in named}})

    def finish(self):
        return self.steps


def _reference(tc: TrainConfig):
    model = GPT(CFG, seed=tc.seed).to(torch.float64)
    r = run(model, optim.build(model, **optimizer_kwargs(tc)), ShardedBatches(CFG.seq_len, tc.batch_size,
                                                                         seed=tc.data_seed),
            steps=tc.steps, probes=[_RefProbe()])
    init = {n: p.detach().clone() for n, p in GPT(CFG, seed=tc.seed).to(torch.float64).named_parameters()}
    return {"losses": r.losses, "steps": r["ref"], "init": init}


def _run(Zero2, world_size: int, seed: int) -> dict:
    """Train the nano GPT for 3 steps with the learner's Zero2 on real ranks, in float64 and in fp32 (once per class,
    world size and seed), and the float64 single-process reference."""
    key = (Zero2, world_size, seed)
    if key not in _RUNS:
        tc = _tc(world_size, seed)
        try:
            ranks = launch(_worker, world_size, Zero2, tc, timeout=120)
        except LaunchError as e:
            text = e.failures[min(e.failures)]
            if "NotImplementedError" in text:
                raise NotImplementedError() from None
            raise RuntimeError(f"rank {min(e.failures)} failed: {text.strip().splitlines()[-1]}") from None
        if any(r == "not implemented" for r in ranks):
            raise NotImplementedError()
        _RUNS[key] = {"ranks": ranks, "ref": _reference(tc)}
    return _RUNS[key]


def _chunk(t: torch.Tensor, world_size: int, rank: int) -> torch.Tensor:
    return t.reshape(-1).tensor_split(world_size)[rank]


def check_zero2_numerics(Zero2, world_size: int, *, seed: int = 0) -> None:
    with check("zero2_numerics") as c:
        run_ = _run(Zero2, world_size, seed)
        ref, N = run_["ref"], world_size
        names = list(ref["init"])
        for rank, res in enumerate(run_["ranks"]):
            mine = res["float64"]["steps"]
            for s in range(STEPS):
                got, want = mine[s], ref["steps"][s]
                before = ref["init"] if s == 0 else ref["steps"][s - 1]["params"]
                for i, name in enumerate(names):
                    where = f"rank {rank}, step {s}, {name}"
                    g, g_ref = got["grad"][i], _chunk(want["grad"][i], N, rank)
                    c.expect(g is not None, f"{where}: grad_chunks[{i}] is None after backward",
                             hint="the hook must keep this rank's chunk of the averaged gradient in "
                                  "self.grad_chunks[i]")
                    c.expect(g.numel() == g_ref.numel(), f"{where}: your gradient chunk has {g.numel()} elements, "
                             f"chunk {rank} of tensor_split({N}) has {g_ref.numel()}",
                             hint="reduce_scatter_ring returns chunk `rank` of the flattened gradient: keep that")
                    dg = (g.reshape(-1) - g_ref).abs().max().item()
                    scale = (g.reshape(-1) @ g_ref).item() / max((g_ref @ g_ref).item(), 1e-300)
                    c.expect(dg < TOL, f"{where}: your averaged gradient chunk differs from chunk {rank} of the "
                             f"single-process gradient by {dg:.1e} (it is {scale:.3f}× the reference)",
                             hint=(f"your chunk is {N}× the average: reduce-scatter with op 'avg', not 'sum' (the "
                                   f"reference's loss is the mean over the whole global batch)" if abs(scale - N) < 1e-3
                                   else "reduce-scatter the whole flattened p.grad with op 'avg' and keep a clone of "
                                        "the chunk it returns (add it to the one you hold if there is one)"))
                    m_ref, v_ref = _chunk(want["m"][i], N, rank), _chunk(want["v"][i], N, rank)
                    m_got, v_got = got["m"][i].reshape(-1), got["v"][i].reshape(-1)
                    p_got, p_ref = _chunk(got["params"][name], N, rank), _chunk(want["params"][name], N, rank)
                    errs = {"m": (m_got - m_ref).abs().max().item(), "v": (v_got - v_ref).abs().max().item(),
                            "updated chunk": (p_got - p_ref).abs().max().item()}
                    wrong = [k for k, e in errs.items() if not e < TOL]
                    if wrong:
                        m0 = _chunk(ref["steps"][s - 1]["m"][i], N, rank) if s else torch.zeros_like(m_ref)
                        v0 = _chunk(ref["steps"][s - 1]["v"][i], N, rank) if s else torch.zeros_like(v_ref)
                        named = _name_mistake(_chunk(before[name], N, rank), g_ref, m0, v0, s + 1, p_got, m_got,
                                              v_got)
                        c.expect(False, f"{where}: the gradient chunk is right, but your {' and '.join(wrong)} "
                                        f"differ{'s' if len(wrong) == 1 else ''} from AdamW's by up to "
                                        f"{max(errs[k] for k in wrong):.1e}"
                                        + (" (gradient, m and v are right)" if wrong == ["updated chunk"] else ""),
                                 hint=named or ("step every parameter's chunk exactly once per step: "
                                                "adamw_step_(my_chunk(p), grad_chunk, m, v, t) with t the number of "
                                                "optimizer steps so far, from 1 — check_adamw checks the update "
                                                "itself"))
                    dfull = (got["params"][name] - want["params"][name]).abs().max().item()
                    c.expect(dfull < TOL, f"{where}: your own chunk is right, but the full parameter differs from the "
                             f"reference by {dfull:.1e} (the other ranks' chunks did not arrive)",
                             hint="after stepping your chunk, all-gather every rank's chunk into the full parameter: "
                                  "all_gather_ring(comm, my_chunk(p), p.numel(), out=p.detach().view(-1))")
        losses = [sum(r["float64"]["losses"][s] for r in run_["ranks"]) / N for s in range(STEPS)]
        d_loss = max(abs(a - b) for a, b in zip(losses, ref["losses"]))
        c.expect(d_loss < TOL, f"the mean of the ranks' losses differs from the reference by {d_loss:.1e}",
                 hint="every rank trains on its own share of each global batch (train.run does that)")
        c.passed(f"{STEPS} steps on {world_size} ranks equal the reference in float64: every gradient chunk, m, v "
                 f"and parameter within {TOL:g}, |Δ loss| ≤ {d_loss:.1e}")


def _chunk_numel(rank: int, world_size: int) -> int:
    return sum(chunk_sizes(p.numel(), world_size)[rank] for p in GPT(CFG).parameters())


def check_zero2_memory(Zero2, world_size: int, *, seed: int = 0) -> None:
    with check("zero2_memory") as c:
        run_ = _run(Zero2, world_size, seed)
        psi = sum(p.numel() for p in GPT(CFG).parameters())
        for rank, res in enumerate(run_["ranks"]):
            r = res["float32"]
            got, mine = r["after_step"], _chunk_numel(rank, world_size)
            left = r["steps"][-1]["grads_left"] or [""]
            c.expect(not r["steps"][-1]["grads_left"], f"rank {rank}: after backward, p.grad is still set for "
                     f"{left[0]} (and {len(left) - 1} more)",
                     hint="ZeRO-2 keeps no full gradient: set p.grad = None in the hook once you have your chunk")
            want = {"parameters": 4 * psi, "gradients": 4 * mine, "optimizer": 8 * mine}
            hints = {"gradients": ("your gradient chunks keep the whole gradients alive (a chunk that is a view "
                                   "holds its parameter's full gradient): keep .clone() of the chunk"
                                   if got["gradients"] == 4 * psi else
                                   "after backward, self.grad_chunks holds this rank's chunk of every gradient, "
                                   "and nothing else"),
                     "optimizer": "m and v for your chunk of each parameter only (zeros_like(my_chunk(p)))",
                     "parameters": "ZeRO-2 keeps the full parameters: update them in place"}
            for cat, b in want.items():
                c.expect(got[cat] == b, f"rank {rank} holds {got[cat]:,} B of {cat} after the step; ZeRO-2 with "
                         f"per-parameter chunks holds exactly {b:,} B", hint=hints[cat])
        c.passed(f"rank 0 holds {4 * psi:,} B parameters, {4 * _chunk_numel(0, world_size):,} B gradients, "
                 f"{8 * _chunk_numel(0, world_size):,} B optimizer state (DDP: {4 * psi:,} / {4 * psi:,} / "
                 f"{8 * psi:,})")


def check_zero2_traffic(Zero2, world_size: int, *, seed: int = 0) -> None:
    with check("zero2_traffic") as c:
        run_ = _run(Zero2, world_size, seed)
        sizes = [p.numel() for p in GPT(CFG).parameters()]
        for rank, res in enumerate(run_["ranks"]):
            sent = res["float32"]["sent"]
            rs = STEPS * sum(ring_reduce_scatter_bytes(n, world_size, rank, 4) for n in sizes)
            ag = STEPS * sum(ring_all_gather_bytes(n, world_size, rank, 4) for n in sizes)
            c.expect(sent == rs + ag, f"rank {rank} sent {sent:,} B in {STEPS} steps; one ring reduce-scatter "
                     f"({rs // STEPS:,} B per step) and one ring all-gather ({ag // STEPS:,} B per step) per parameter "
                     f"send exactly {rs + ag:,} B",
                     hint="reduce_scatter_ring once per gradient (in the hook), all_gather_ring once per parameter "
                          "(in step), nothing else" + (" — you send twice that: an all-reduce where a reduce-scatter "
                                                       "is enough?" if sent == 2 * (rs + ag) else ""))
        total = sum(r["float32"]["sent"] for r in run_["ranks"])
        ddp = STEPS * 2 * (world_size - 1) * 4 * sum(sizes)
        c.expect(total == ddp, f"all ranks together sent {total:,} B, DDP's ring all-reduce sends {ddp:,} B",
                 hint="one ring reduce-scatter and one ring all-gather per parameter and step")
        c.passed(f"{run_['ranks'][0]['float32']['sent'] // STEPS:,} B per step from rank 0; all ranks together "
                 f"{total // STEPS:,} B per step = DDP's 2(N−1)·4Ψ")
