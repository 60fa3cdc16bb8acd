"""The rank mesh (course_lib.distributed.mesh) on real ranks: the groups are the expected rank sets, every axis books
its traffic under its own name in the one ledger, axes of size 1 cost nothing, and data is split by dp rank only."""
import pytest
import torch

from course_lib import optim
from course_lib.core.model import GPT, get_config
from course_lib.distributed import collectives as C
from course_lib.distributed.launch import launch
from course_lib.distributed.mesh import AXES, Mesh, data_parallel_batches
from course_lib.parallel.dp import apply_dp
from course_lib.train import LedgerProbe, TrainConfig, optimizer_kwargs, run, train_reference

pytestmark = pytest.mark.integration


def _describe(ctx, sizes):
    mesh = Mesh(ctx.comm, **sizes)
    return {"coords": mesh.coords, "groups": {a: mesh.group_of(a) for a in AXES},
            "comm_ranks": {a: (mesh[a].rank, mesh[a].world_size, mesh[a].global_ranks) for a in AXES}}


def test_groups_of_a_2x2x2_mesh_are_the_expected_rank_sets_tp_innermost():
    res = launch(_describe, 8, {"pp": 2, "dp": 2, "tp": 2}, timeout=120)
    expect = {"tp": [{0, 1}, {2, 3}, {4, 5}, {6, 7}], "dp": [{0, 2}, {1, 3}, {4, 6}, {5, 7}],
              "pp": [{0, 4}, {1, 5}, {2, 6}, {3, 7}]}
    for rank, r in enumerate(res):
        assert r["coords"] == {"pp": rank // 4, "dp": (rank // 2) % 2, "cp": 0, "tp": rank % 2}
        assert r["groups"]["cp"] == [rank] and r["comm_ranks"]["cp"][1] == 1      # cp = 1: a group of one
        for axis in ("pp", "dp", "tp"):
            group = set(r["groups"][axis])
            assert group in expect[axis], (rank, axis, group)
            local, size, ranks = r["comm_ranks"][axis]
            assert size == 2 and set(ranks) == group and ranks[local] == rank
            assert local == r["coords"][axis]          # a group's ranks are in grid order along its axis


def _sub_axes(ctx, sizes):
    mesh = Mesh(ctx.comm, **sizes)
    x = torch.full((6,), float(ctx.rank + 1))
    C.all_reduce_ring(mesh.group("dp", "cp"), x, tag="dpcp")
    return {"coords": mesh.coords, "ranks": {a: mesh[a].global_ranks for a in AXES + ("ep", "edp")},
            "dpcp": mesh.group("dp", "cp").global_ranks, "sum": x[0].item()}


def test_cp_sits_between_dp_and_tp_and_ep_splits_dp_into_expert_groups():
    res = launch(_sub_axes, 8, {"dp": 2, "cp": 2, "tp": 2}, timeout=120)
    for rank, r in enumerate(res):
        assert r["coords"] == {"pp": 0, "dp": rank // 4, "cp": (rank // 2) % 2, "tp": rank % 2}
        assert r["ranks"]["cp"] == sorted({rank, rank ^ 2}) and r["ranks"]["dp"] == sorted({rank, rank ^ 4})
        assert r["dpcp"] == [q for q in range(8) if q % 2 == rank % 2]            # the dp×cp gradient group
        assert r["sum"] == sum(q + 1 for q in r["dpcp"])
    res = launch(_sub_axes, 8, {"dp": 4, "ep": 2, "tp": 2}, timeout=120)
    for rank, r in enumerate(res):
        dp = r["coords"]["dp"]
        same_tp = [q for q in range(8) if q % 2 == rank % 2]                       # dp ranks 0..3 of this tp slot
        assert r["ranks"]["ep"] == [same_tp[d] for d in range(4) if d // 2 == dp // 2]   # consecutive dp ranks
        assert r["ranks"]["edp"] == [same_tp[d] for d in range(4) if d % 2 == dp % 2]    # the same experts


def _gpt_on_mesh(ctx, cfg, tc):
    """Plain DP over the dp axis on a 2×2×2 mesh, while every tp group and every pp group runs a ring all-reduce
    of its own: the ledger must book each axis's bytes under its name."""
    mesh = Mesh(ctx.comm, dp=2, pp=2, tp=2)
    model = apply_dp(GPT(cfg, seed=tc.seed), mesh, kind="bucket", bucket_cap_bytes=16 * 1024)
    batches = data_parallel_batches(mesh, cfg.seq_len, tc.batch_size, seed=tc.data_seed)
    ctx.comm.ledger.reset()
    out = run(model, optim.build(model, **optimizer_kwargs(tc)), batches, steps=tc.steps,
              probes=[LedgerProbe(ctx.comm, groups=AXES)], keep_params=True)
    tp_buf = torch.full((1000,), float(mesh.tp_rank + 1))
    C.all_reduce_ring(mesh["tp"], tp_buf, tag="tp_demo")
    pp_buf = torch.full((300,), float(mesh.pp_rank + 1))
    C.all_reduce_ring(mesh["pp"], pp_buf, tag="pp_demo")
    L = ctx.comm.ledger
    return {"losses": out.losses, "params": out.params, "x0": batches.get(0)[0],
            "bytes": {a: L.bytes_sent(group=a) for a in AXES}, "total": L.bytes_sent(),
            "world": L.bytes_sent(group="world"), "step_groups": out["ledger"]["group_bytes"],
            "tp": tp_buf[0].item(), "pp": pp_buf[0].item(), "numels": model.bucket_numels(),
            "coords": mesh.coords}


def test_gpt_data_parallel_on_a_2x2x2_mesh_with_per_axis_ledger_bytes():
    cfg, tc = get_config("nano"), TrainConfig(steps=2, batch_size=8, lr=1e-3)
    ref = train_reference(cfg, tc, progress=False)
    res = launch(_gpt_on_mesh, 8, cfg, tc, timeout=240)
    ref_params = {k: v.detach() for k, v in ref.model.named_parameters()}
    for rank, r in enumerate(res):
        # DP over dp only: the 4 ranks of one dp coordinate saw the same data and trained the same model
        same = [q for q in res if q["coords"]["dp"] == r["coords"]["dp"]]
        assert all(torch.equal(q["x0"], r["x0"]) for q in same)
        for k, v in ref_params.items():
            assert (r["params"][k] - v).abs().max().item() < 1e-5, (rank, k)
        dp_bytes = tc.steps * sum(C.ring_all_reduce_bytes(n, 2, r["coords"]["dp"], 4) for n in r["numels"])
        assert r["bytes"] == {"dp": dp_bytes, "cp": 0, "tp": C.ring_all_reduce_bytes(1000, 2, r["coords"]["tp"], 4),
                              "pp": C.ring_all_reduce_bytes(300, 2, r["coords"]["pp"], 4)}
        assert sum(r["bytes"].values()) == r["total"] and r["world"] == 0       # the axes add up to the total
        assert [s["dp"] for s in r["step_groups"]] == [dp_bytes // tc.steps] * tc.steps
        assert [s["tp"] for s in r["step_groups"]] == [0, 0]                    # tp and pp were quiet in training
        assert r["tp"] == 3.0 and r["pp"] == 3.0                                # 1 + 2 in each group
    mean = [sum(q["losses"][s] for q in res) / 8 for s in range(tc.steps)]
    assert max(abs(a - b) for a, b in zip(mean, ref.losses)) < 1e-5


def _solo_axes(ctx):
    mesh = Mesh(ctx.comm)                                   # dp = world, pp = tp = 1
    t = torch.ones(10)
    mesh["tp"].all_reduce(t, "sum")
    C.all_reduce_ring(mesh["pp"], t)
    mesh["tp"].barrier()
    C.all_reduce_ring(mesh["dp"], t, tag="dp")
    return {"events": [(e.group, e.op) for e in ctx.comm.ledger.events if e.sent], "t": t[0].item(),
            "sizes": mesh.sizes, "dp_is_world": mesh["dp"].group is ctx.comm.group}


def test_axes_of_size_one_cost_nothing_and_a_whole_world_axis_reuses_the_world_group():
    res = launch(_solo_axes, 3, timeout=60)
    for r in res:
        assert r["sizes"] == {"pp": 1, "dp": 3, "cp": 1, "tp": 1} and r["dp_is_world"]
        assert r["t"] == 3.0 and {g for g, _ in r["events"]} == {"dp"}


def _bad(ctx):
    errors = {}
    for name, kw in {"product": {"dp": 2, "tp": 2}, "tp not dividing": {"tp": 4}, "zero": {"pp": 0},
                     "float": {"tp": 1.5}, "ep": {"ep": 4}}.items():
        try:
            Mesh(ctx.comm, **kw)
            errors[name] = None
        except ValueError as e:
            errors[name] = str(e)
    try:
        Mesh(ctx.comm)["sp"]
    except KeyError as e:
        errors["axis"] = str(e)
    return errors


def test_bad_mesh_sizes_say_what_to_change_before_any_group_is_made():
    e = launch(_bad, 6, timeout=60)[0]
    assert "must equal the world size" in e["product"] and "6 ranks" in e["product"]
    assert "does not divide the world size 6" in e["tp not dividing"]
    assert "positive integer" in e["zero"] and "positive integer" in e["float"]
    assert "'sp'" in e["axis"]
    assert "ep=4 must divide dp=6" in e["ep"]
