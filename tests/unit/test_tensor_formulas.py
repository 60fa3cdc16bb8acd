"""Tensor parallelism's closed forms and plans, on one process: activation bytes per layer against the model's own
op-by-op count and the paper's published forms, grid bytes against the collectives' per-rank formulas summed step by
step, grid layouts that tile every matrix, and the errors bad sizes raise before anything communicates."""
import types

import pytest
import torch
import torch.nn.functional as F

from course_lib.core.model import GPT, GPTConfig, block_activation_bytes
from course_lib.distributed.collectives import (
    ring_all_gather_bytes,
    ring_reduce_scatter_bytes,
    tree_broadcast_bytes,
    tree_reduce_bytes,
)
from course_lib.parallel.tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    check_tp,
    colossal_bandwidth,
    grid_bytes,
    grid_of,
    layer_activation_bytes,
    layer_bytes,
    make_grid,
    paper_activation_bytes,
    sp_layer_bytes,
    tp_bytes_per_microbatch,
    tp_bytes_per_step,
    tp_plan,
    vocab_parallel_cross_entropy,
)

SOLO = types.SimpleNamespace(world_size=1, rank=0)     # a one-rank group: the collectives return at once


@pytest.mark.parametrize("cfg, batch", [(GPTConfig(), 3), (GPTConfig(seq_len=24, n_head=12, d_model=48), 4)])
def test_activation_bytes_at_t1_equal_the_models_op_by_op_count(cfg, batch):
    got = layer_activation_bytes(cfg.seq_len, batch, cfg.d_model, cfg.n_head, 1, elem=4)["total"]
    assert got == block_activation_bytes(cfg, batch, elem_bytes=4)


def test_activation_core_is_the_papers_formula_without_dropout_for_every_t():
    s, b, h, a = 24, 4, 48, 12
    for t in (1, 2, 3, 4, 6):
        for sp in (False, True):
            terms = layer_activation_bytes(s, b, h, a, t, sequence_parallel=sp, elem=2)
            core = terms["total"] - terms["LN mean/rstd"] - terms["causal mask"]
            # the paper's 16-bit forms, dropout removed: its two 1-byte masks per token (split by SP only), and
            # in the scores (split by heads) the 1-byte mask and the 2-byte dropout output
            masks = 2 * s * b * h / (t if sp else 1) + a * s * s * b / t
            dropout_out = 2 * a * s * s * b / t
            assert core == paper_activation_bytes(s, b, h, a, t, sp) - masks - dropout_out
    assert paper_activation_bytes(s, b, h, a, 1) == s * b * h * (34 + 5 * a * s / h)


def test_sequence_parallel_divides_every_activation_term_by_t():
    base = layer_activation_bytes(24, 4, 48, 12, 1, elem=8)
    for t in (2, 3, 4):
        sp = layer_activation_bytes(24, 4, 48, 12, t, sequence_parallel=True, elem=8)
        assert all(sp[k] * t == base[k] for k in base if k not in ("causal mask", "total"))
        keep = layer_activation_bytes(24, 4, 48, 12, t, sequence_parallel=True, regather=False, elem=8)
        assert keep["total"] - sp["total"] == 2 * 8 * 24 * 4 * 48 * (t - 1) // t


@pytest.mark.parametrize("t", [2, 3, 4])
def test_sp_layer_bytes_equal_1d_layer_bytes_when_t_divides_bsh(t):
    assert all(sp_layer_bytes(4, 24, 48, t, r, 8) == layer_bytes(4, 24, 48, t, r, 8) == 8 * 4 * 24 * 48 * (t - 1)
               // t * 8 for r in range(t))


@pytest.mark.parametrize("q", [2, 3, 4])
def test_2d_bytes_are_the_tree_broadcasts_and_reduces_summed_over_the_steps(q):
    R = K = N = 12 * q
    xb, wb = R * K // q ** 2, K * N // q ** 2          # block elements of X (and dX) and of W (and dW)
    for i in range(q):
        for j in range(q):
            steps = sum(tree_broadcast_bytes(xb, q, j, 8, root=k) + tree_broadcast_bytes(wb, q, i, 8, root=k)  # fwd
                        + tree_broadcast_bytes(wb, q, i, 8, root=k) + tree_reduce_bytes(xb, q, j, 8, root=k)   # dX
                        + tree_broadcast_bytes(xb, q, j, 8, root=k) + tree_reduce_bytes(wb, q, i, 8, root=k)   # dW
                        for k in range(q))
            assert steps == grid_bytes("2D", R, K, N, q=q, elem=8) == 3 * (q - 1) * (xb + wb) * 8
    assert grid_bytes("2.5D", R, K, N, q=q, d=1, elem=8) == grid_bytes("2D", R, K, N, q=q, elem=8)


def test_1d_and_3d_bytes_are_the_colossal_forms_exactly_and_2d_a_q_th_of_them():
    S = 48 * 48
    for P in (2, 4, 8):
        assert grid_bytes("1D", 48, 48, 48, q=P) == colossal_bandwidth("1D", q=P) * S * 4
    assert grid_bytes("3D", 48, 48, 48, q=2) == colossal_bandwidth("3D", q=2) * S * 4
    for q in (2, 3, 4):
        assert grid_bytes("2D", 48, 48, 48, q=q) * q == pytest.approx(colossal_bandwidth("2D", q=q) * S * 4)
    depth = 2 * ring_reduce_scatter_bytes(48 * 48 // 4, 2, 0, 4)            # the all-reduce of dW over d = 2
    assert (grid_bytes("2.5D", 48, 48, 48, q=2, d=2) - depth) * 2 == colossal_bandwidth("2.5D", q=2, d=2) * S * 4


@pytest.mark.parametrize("kind, P, d, copies", [("1D", 3, 1, {"input": 3, "weight": 1, "output": 1}),
                                                ("2D", 9, 1, {"input": 1, "weight": 1, "output": 1}),
                                                ("2.5D", 8, 2, {"input": 1, "weight": 2, "output": 1}),
                                                ("2.5D", 12, 3, {"input": 1, "weight": 3, "output": 1}),
                                                ("3D", 8, 1, {"input": 1, "weight": 1, "output": 1})])
def test_grid_layouts_tile_every_matrix(kind, P, d, copies):
    for role, n in copies.items():
        held = torch.zeros(36, 36, dtype=torch.int64)
        for rank in range(P):
            rows, cols = grid_of(kind, P, rank, depth=d).layout(role, (36, 36))
            held[rows, cols] += 1
        assert bool((held == n).all()), (kind, role)


def test_bad_grids_and_splits_name_the_fix_before_touching_a_communicator():
    with pytest.raises(ValueError, match="square number of ranks"):
        make_grid(types.SimpleNamespace(world_size=8, rank=0), "2D")
    with pytest.raises(ValueError, match="cube number of ranks"):
        make_grid(types.SimpleNamespace(world_size=9, rank=0), "3D")
    with pytest.raises(ValueError, match="q×q×depth"):
        make_grid(types.SimpleNamespace(world_size=8, rank=0), "2.5D", depth=3)
    with pytest.raises(ValueError, match="multiple of 4"):
        grid_of("3D", 8, 0).layout("input", (6, 8))
    cfg = GPTConfig(seq_len=24, n_head=12, d_model=48)
    with pytest.raises(ValueError, match="n_head=12"):
        check_tp(cfg, 5)
    with pytest.raises(ValueError, match="seq_len=25"):
        check_tp(cfg.replace(seq_len=25), 2, sequence_parallel=True)
    with pytest.raises(ValueError, match="pad_vocab=True"):
        check_tp(cfg, 3, pad_vocab=False)
    assert check_tp(cfg, 3) == 258 and check_tp(cfg, 4) == 256


def test_the_plan_puts_f_once_per_region_and_the_naive_plan_in_every_column_layer():
    model = GPT(GPTConfig(n_layer=1))
    plan = dict(tp_plan(model))
    assert plan["blocks.0.attn"] == plan["blocks.0.mlp"] == "region" and plan["blocks.0.attn.wo"] == "rowwise"
    assert [n for n, s in tp_plan(model) if s == "colwise"] == ["blocks.0.attn.wq", "blocks.0.attn.wk",
                                                                "blocks.0.attn.wv", "blocks.0.mlp.fc_in"]
    assert "blocks.0.attn" not in dict(tp_plan(model, plan="naive"))
    assert dict(tp_plan(model, sequence_parallel=True))["blocks.0.ln1"] == "sequence"
    with pytest.raises(ValueError, match="plan='megatron'"):
        tp_plan(model, sequence_parallel=True, plan="naive")


def test_sp_bytes_add_regathers_and_parameter_sums_to_1d_bytes():
    cfg = GPTConfig(seq_len=24, n_head=12, d_model=48)
    one = tp_bytes_per_microbatch(cfg, 4, 4, 0, 8)
    sp = tp_bytes_per_microbatch(cfg, 4, 4, 0, 8, sequence_parallel=True)
    assert sp["layers"] == one["layers"] and sp["embed+head"] == one["embed+head"]
    assert sp["regather"] == 5 * ring_all_gather_bytes(4 * 24 * 48, 4, 0, 8)


def test_layers_on_a_group_of_one_are_the_plain_layers():
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 12).double()
    x = torch.randn(2, 3, 8, dtype=torch.float64)
    assert torch.equal(ColumnParallelLinear(lin, SOLO)(x), lin(x))
    assert torch.allclose(RowParallelLinear(lin, SOLO)(x), lin(x), atol=1e-15)


def test_vocab_parallel_cross_entropy_masks_padding_and_matches_cross_entropy():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 7, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 7, (2, 5))
    padded = torch.cat([logits, torch.full((2, 5, 2), 3.0, dtype=torch.float64)], dim=-1)   # 2 padding columns
    ours = vocab_parallel_cross_entropy(padded, targets, SOLO, start=0, vocab_size=7)
    ref = F.cross_entropy(logits.reshape(-1, 7), targets.reshape(-1))
    assert abs(ours.item() - ref.item()) < 1e-14
    (g_ours,) = torch.autograd.grad(ours, logits)
    (g_ref,) = torch.autograd.grad(ref, logits)
    assert (g_ours - g_ref).abs().max().item() < 1e-15


@pytest.mark.parametrize("sp, plan", [(False, "megatron"), (True, "megatron"), (False, "naive")])
@pytest.mark.parametrize("pp, chunks", [(2, 1), (3, 1), (2, 2)])
def test_tp_bytes_of_the_pipeline_stages_add_up_to_the_whole_models(sp, plan, pp, chunks):
    """Per stage, `tp_bytes_per_microbatch` counts only its blocks, the embedding where stage 0 is and the head
    and loss where the last stage is: over the pp ranks every part adds up to the unsplit model's, for any split."""
    from course_lib.parallel.pipeline import plan_pipeline
    cfg = GPTConfig(seq_len=12, n_layer=4, n_head=4, d_model=24)
    layout = plan_pipeline(cfg, pp, 2 * pp, "interleaved" if chunks > 1 else "1f1b", chunks=chunks)
    for t, rank in ((2, 1), (3, 2), (4, 0)):
        whole = tp_bytes_per_microbatch(cfg, 2, t, rank, 8, sequence_parallel=sp, plan=plan)
        parts = [tp_bytes_per_microbatch(cfg, 2, t, rank, 8, sequence_parallel=sp, plan=plan, **layout.parts(p))
                 for p in range(pp)]
        assert {k: sum(part[k] for part in parts) for k in whole} == whole
        assert [p["layers"] for p in parts] == [layout.parts(p)["layers"] * whole["layers"] // cfg.n_layer
                                                for p in range(pp)]
        assert tp_bytes_per_step(cfg, 2, t, rank, 8, num_microbatches=3, sequence_parallel=sp, plan=plan) \
            == 3 * sum(whole.values())


def test_the_plan_of_a_pipeline_stage_covers_only_what_the_stage_holds():
    from course_lib.parallel.pipeline import PipelineStage, split_layers
    gpt = GPT(GPTConfig(n_layer=3))
    bounds = split_layers(3, 3)
    plans = [dict(tp_plan(PipelineStage(gpt, [k], bounds, 3))) for k in range(3)]
    whole = dict(tp_plan(GPT(GPTConfig(n_layer=3))))
    assert {n: s for p in plans for n, s in p.items()} == whole        # the stages partition the GPT's table
    assert "wte" in plans[0] and "lm_head" in plans[2] and not {"wte", "ln_f", "lm_head"} & plans[1].keys()
    assert {n.split(".")[1] for n in plans[1] if n.startswith("blocks.")} == {"1"}   # the GPT's index of its block
