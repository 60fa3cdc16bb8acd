"""The pipeline executor on real gloo ranks (course_lib.parallel.pipeline): every synchronous schedule — GPipe,
1F1B, interleaved 1F1B, ZB-H1 — gives the single-process gradients and loss at S = 2, 3, 4 stages and
M ∈ {1, S, 2S+1} micro-batches (interleaved: M ∈ {1, S, 2S}, its rounds must divide M), with uneven splits; each
rank runs exactly its schedule's ops in order; the memory accountant measures exactly the activations the schedule
predicts (GPipe M, 1F1B S − stage, interleaved per its op list; ZB-H1 between 1F1B's count and p·M_B); the ledger
shows exactly 2·M·b·T·d·e per boundary; a 2 (dp) × 2 (pp) mesh equals the reference with exact bytes per axis; bad
input fails at once on every rank.

Exact by construction: float64, where a pipeline only regroups the same additions (per micro-batch, then summed),
so gradients agree to ~1e-16; GRAD_TOL = 1e-12 leaves room for 1e4 ulps. One launch per world size runs everything.
"""
from __future__ import annotations

import functools
import time

import pytest
import torch

from course_lib.composer.parallelize import ParallelPlan, parallelize
from course_lib.core.data import ShardedBatches
from course_lib.core.model import GPT, get_config
from course_lib.distributed.launch import LaunchError, launch
from course_lib.distributed.mesh import Mesh
from course_lib.parallel import pipeline as P
from course_lib.train import GradProbe, LedgerProbe, MemoryProbe, TrainConfig, train_reference

pytestmark = pytest.mark.integration

CFG = get_config("nano", n_layer=12, seq_len=16)    # 12 blocks: 2, 3 and 4 stages, interleaved v = 2, 2, 3
B = 2                                               # sequences per micro-batch
GRAD_TOL = 1e-12
CHUNKS = {2: 2, 3: 2, 4: 3}                         # v for the interleaved runs at each S
UNEVEN = {2: [7, 5], 3: [5, 4, 3], 4: [4, 3, 3, 2]}
STAGES = [2, 3]                                     # an even and an odd number of stages; notebook 05 runs 4 and 3


def _cases(S):
    """(schedule, M, chunks, layers) run at S stages."""
    out = [(name, M, 1, None) for name in ("gpipe", "1f1b", "zb_h1") for M in sorted({1, S, 2 * S + 1})]
    out += [("interleaved", M, CHUNKS[S], None) for M in sorted({1, S, 2 * S})]
    out += [(name, S + 1, 1, UNEVEN[S]) for name in ("1f1b", "zb_h1")]
    return out


def _steps(case) -> int:
    """Two optimizer steps (the optimizer must step every stage's parameters with those gradients) for 1F1B and
    ZB-H1 on the uneven split; one step, whose gradients are compared, for the rest."""
    return 2 if case[3] is not None else 1


def _memory_cases(S):
    return [("gpipe", 2 * S + 1, 1), ("1f1b", 2 * S + 1, 1), ("interleaved", 2 * S, CHUNKS[S]), ("zb_h1", 2 * S + 1, 1)]


def _train(mesh, tc, *, dtype=None, probes=(), keep_params=False, **plan):
    """Train the course GPT as the plan's pipeline (pp = the mesh's) through `parallelize`: (Run, stage, executor)."""
    model = GPT(CFG, seed=tc.seed)
    model = model.to(dtype) if dtype is not None else model
    plan = ParallelPlan(pp=mesh.size("pp"), dp=mesh.size("dp"), **plan)
    with parallelize(model, mesh, plan, train_config=tc) as job:
        r = job.train(tc.steps, probes=probes, keep_params=keep_params)
    return r, job.pipeline.stage, job.pipeline


def _everything(ctx):
    S = ctx.world_size
    mesh = Mesh(ctx.comm, pp=S)
    out = {"exact": {}, "memory": {}}
    for name, M, v, layers in _cases(S):
        ctx.comm.ledger.reset()
        tc = TrainConfig(steps=_steps((name, M, v, layers)), batch_size=M * B)
        r, stage, pipe = _train(mesh, tc, schedule=name, microbatches=M, chunks=v, layers=layers,
                                dtype=torch.float64, probes=[GradProbe()], keep_params=True)
        out["exact"][(name, M, v, tuple(layers) if layers else None)] = {
            "grads": r["grads"], "losses": r.losses, "params": r.params, "sent": ctx.comm.ledger.bytes_sent(group="pp"),
            "ran": [op for step, op, _, _ in pipe.records if step == tc.steps - 1], "stages": stage.stages}
    for name, M, v in _memory_cases(S):
        ctx.comm.ledger.reset()
        tc = TrainConfig(steps=1, batch_size=M * B)
        r, _, _ = _train(mesh, tc, schedule=name, microbatches=M, chunks=v,
                         probes=[MemoryProbe(timeline=False), LedgerProbe(ctx.comm, groups=("pp",))])
        out["memory"][name] = {"activations": r["memory"]["report"].max_by_category["activations"],
                               "pp": r["ledger"]["group_bytes"][0]["pp"]}
    return out


@functools.cache
def _runs(S: int):
    return launch(_everything, S, timeout=300)


@functools.cache
def _reference(M: int):
    """One process on the same M·B sequences, float64: step-0 gradients, two steps of losses and parameters."""
    model = GPT(CFG).double()
    model(*ShardedBatches(CFG.seq_len, M * B).global_batch(0))[1].backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    ref = train_reference(CFG, TrainConfig(steps=2, batch_size=M * B), model=GPT(CFG).double(), progress=False)
    return grads, ref.losses, {k: p.detach() for k, p in ref.model.named_parameters()}


def _merged(ranks, key: str, case) -> dict:
    out = {}
    for r in ranks:
        part = r["exact"][case][key]
        assert not (out.keys() & part.keys()), "a parameter lives on two ranks"
        out.update(part)
    return out


@pytest.mark.parametrize("S", STAGES)
def test_every_schedule_gives_the_single_process_gradients_loss_and_parameters(S):
    ranks = _runs(S)
    for case in ranks[0]["exact"]:
        name, M, v, layers = case
        ref_grads, ref_losses, ref_params = _reference(M)
        grads = _merged(ranks, "grads", case)
        assert grads.keys() == ref_grads.keys(), case
        dg = max((grads[k] - ref_grads[k]).abs().max().item() for k in grads)
        assert dg < GRAD_TOL, (case, dg)
        last = next(r for r in ranks if S * v - 1 in r["exact"][case]["stages"])
        assert max(abs(a - b) for a, b in zip(last["exact"][case]["losses"], ref_losses)) < GRAD_TOL, case
        if _steps(case) == 2:                                 # two AdamW steps on the stages' parameters
            params = _merged(ranks, "params", case)
            assert max((params[k] - ref_params[k]).abs().max().item() for k in params) < 1e-10, case


@pytest.mark.parametrize("S", STAGES)
def test_each_rank_runs_exactly_its_schedule_in_order(S):
    for rank, r in enumerate(_runs(S)):
        for (name, M, v, _), res in r["exact"].items():
            want = [str(op) for op in P.make_schedule(name, S, M, v).ops[rank]]
            assert res["ran"] == want, (name, M, rank)


@pytest.mark.parametrize("S", STAGES)
def test_ledger_carries_exactly_2_m_b_t_d_e_per_boundary(S):
    ranks = _runs(S)
    for case in ranks[0]["exact"]:
        name, M, v, layers = case
        plan = P.plan_pipeline(CFG, S, M, name, chunks=v, layers=layers)
        want = P.boundary_bytes(plan, B, CFG.seq_len, CFG.d_model, 8)
        assert [r["exact"][case]["sent"] for r in ranks] == [_steps(case) * w for w in want], case   # float64
        assert sum(want) == (S * v - 1) * 2 * M * B * CFG.seq_len * CFG.d_model * 8
    for name, M, v in _memory_cases(S):
        plan = P.plan_pipeline(CFG, S, M, name, chunks=v)
        assert [r["memory"][name]["pp"] for r in ranks] == P.boundary_bytes(plan, B, CFG.seq_len, CFG.d_model, 4)


@pytest.mark.parametrize("S", STAGES)
def test_activation_peaks_per_stage_are_what_the_schedule_predicts(S):
    ranks = _runs(S)
    for name, M, v in _memory_cases(S):
        plan = P.plan_pipeline(CFG, S, M, name, chunks=v)
        units = {k: P.stage_activation_bytes(CFG, plan.bounds, k, B) for k in range(S * v)}
        got = [r["memory"][name]["activations"] for r in ranks]
        if name == "gpipe":
            assert got == [M * units[r] for r in range(S)]                              # all M micro-batches
        elif name == "1f1b":
            assert got == [min(S - r, M) * units[r] for r in range(S)]                  # S − stage
        elif name == "interleaved":
            assert got == P.peak_bytes(plan.schedule, units)
        else:   # ZB-H1: 1F1B's full micro-batches, plus W's inputs; Qi et al.'s p·M_B (+ one received gradient)
            lo, hi = P.in_flight(plan.schedule), P.in_flight(plan.schedule, "W")
            slack = B * CFG.seq_len * CFG.d_model * 4
            assert all(lo[r] * units[r] <= got[r] <= hi[r] * units[r] + slack for r in range(S)), got


# ---------------------------------------------------------------------------------------------- dp × pp
def _dp_pp(ctx, tc, M):
    mesh = Mesh(ctx.comm, dp=2, pp=2)
    out = {}
    for label, kwargs in (("ddp", {}), ("ddp_overlap", {"dp_kind": "overlap"}), ("zero1", {"zero": 1})):
        ctx.comm.ledger.reset()
        r, stage, pipe = _train(mesh, tc, microbatches=M, dtype=torch.float64, keep_params=True,
                                probes=[LedgerProbe(ctx.comm, groups=("pp", "dp"))], **kwargs)
        ddp = pipe.data_parallel
        out[label] = {"params": r.params, "losses": r.losses, "per_step": r["ledger"]["group_bytes"],
                      "psi": sum(p.numel() for p in stage.parameters()),
                      "dp_expected": ddp.expected_bytes_sent() if ddp is not None else None}
    return {"runs": out, "coords": mesh.coords}


def test_1f1b_with_ddp_on_a_2x2_mesh_equals_the_reference_with_exact_bytes_per_axis():
    M = 3
    tc = TrainConfig(steps=2, batch_size=2 * M * B)
    res = launch(_dp_pp, 4, tc, M, timeout=300)
    ref = train_reference(CFG, tc, model=GPT(CFG).double(), progress=False)
    ref_params = {k: p.detach() for k, p in ref.model.named_parameters()}
    pp_bytes = P.boundary_bytes(P.plan_pipeline(CFG, 2, M), B, CFG.seq_len, CFG.d_model, 8)
    for r in res:
        for label, run in r["runs"].items():
            d = max((run["params"][k] - ref_params[k]).abs().max().item() for k in run["params"])
            assert d < 1e-10, (label, r["coords"], d)
            assert [s["pp"] for s in run["per_step"]] == [pp_bytes[r["coords"]["pp"]]] * 2
            if label.startswith("ddp"):   # ring all-reduce over N = 2: 2(N−1)/N·Ψ·e = Ψ·e per step, exactly
                assert [s["dp"] for s in run["per_step"]] == [run["dp_expected"]] * 2 == [run["psi"] * 8] * 2
    for label in res[0]["runs"]:
        losses = [sum(r["runs"][label]["losses"][s] for r in res if r["coords"]["pp"] == 1) / 2 for s in range(2)]
        assert max(abs(a - b) for a, b in zip(losses, ref.losses)) < 1e-10


# ---------------------------------------------------------------------------------------------- bad input
def _apply(ctx, kwargs):
    mesh = Mesh(ctx.comm, pp=kwargs.pop("pp"))
    P.apply_pipeline(GPT(CFG), mesh, **kwargs)
    return "ran"


@pytest.mark.parametrize("world_size, kwargs, match", [
    (3, dict(pp=3, num_microbatches=0), "use num_microbatches ≥ 1"),
    (2, dict(pp=2, num_microbatches=2, schedule="interleaved", chunks=5), "does not divide the layers per rank"),
    (3, dict(pp=2, num_microbatches=2), "pp × cp × tp = 2 × 1 × 1 = 2 does not divide the world size 3"),
])
def test_bad_input_fails_on_every_rank_at_once_with_the_fix(world_size, kwargs, match):
    t0 = time.perf_counter()
    with pytest.raises(LaunchError, match=match) as err:
        launch(_apply, world_size, kwargs, timeout=60)
    assert "timed out" not in str(err.value) and time.perf_counter() - t0 < 30
    assert len(err.value.failures) == world_size              # every rank raised it itself, nobody waited


def test_more_stages_than_layers_is_refused_before_launch():
    with pytest.raises(ValueError, match="use pp_size·chunks ≤ 12"):
        P.plan_pipeline(CFG, 13, 4, world_size=13)
