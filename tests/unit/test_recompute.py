"""Activation recomputation (course_lib.memopt.recompute): our checkpoint against no checkpointing and against
torch.utils.checkpoint, its bytes against the memory accountant, torch's MemTracker and the closed forms, its FLOPs
against FlopCounterMode, and the optimal plan against brute force."""
from functools import partial

import pytest
import torch
from torch.utils.checkpoint import checkpoint as torch_checkpoint
from torch.utils.checkpoint import create_selective_checkpoint_contexts
from torch.utils.flop_counter import FlopCounterMode

from course_lib import optim
from course_lib.core.data import ShardedBatches
from course_lib.core.handles import handle_of
from course_lib.core.model import GPT, activation_bytes, block_activation_bytes, get_config, lm_loss
from course_lib.memopt.recompute import (
    CheckpointError,
    RecomputePlan,
    Unit,
    all_but_matmuls,
    apply_recompute,
    attention_core,
    checkpoint,
    make_plan,
    recompute_all,
    remove_recompute,
    torch_policy,
)
from course_lib.memopt.recompute.costs import formula_costs, plan_extra, plan_peak
from course_lib.memopt.recompute.measured import FlopProbe, activation_peak, measure_costs
from course_lib.memopt.recompute.optimum import min_budget, optimal_plan, pareto_front
from course_lib.memory import MemoryTracker
from course_lib.train import GradProbe, MemoryProbe, TrainConfig, optimizer_kwargs, run

POLICIES = {"full": recompute_all, "selective": attention_core, "all_but_matmuls": all_but_matmuls}


def _blocks_step(cfg, wrap, *, batch=3, seed=0):
    """One forward and backward of the GPT with each block passed through wrap(block, h); (grads, extra FLOPs, loss).
    Dropout draws from the global generator, seeded the same way for every variant."""
    m = GPT(cfg, seed=0)
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len), generator=g)
    y = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len), generator=g)
    torch.manual_seed(123)
    with FlopCounterMode(display=False) as fc:
        h = m.embed(x)
        for block in m.blocks:
            h = wrap(block, h)
        loss = lm_loss(m.head(h), y)
        forward = fc.get_total_flops()
        loss.backward()
    return {n: p.grad for n, p in m.named_parameters()}, fc.get_total_flops() - 3 * forward, loss.item()


def _plain(block, h):
    return block(h)


def _torch_sac(policy):
    context = partial(create_selective_checkpoint_contexts, torch_policy(policy), allow_cache_entry_mutation=True)
    return lambda block, h: torch_checkpoint(block, h, use_reentrant=False, context_fn=context)


def _assert_bitwise(grads, ref):
    assert grads.keys() == ref.keys()
    for name in ref:
        assert torch.equal(grads[name], ref[name]), name


# ------------------------------------------------------------------------------------------- numerics
@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("policy", list(POLICIES))
def test_gradients_are_bitwise_those_of_no_checkpointing_even_with_dropout(policy, dropout):
    cfg = get_config("nano", dropout=dropout)
    ref, _, loss_ref = _blocks_step(cfg, _plain)
    grads, _, loss = _blocks_step(cfg, lambda b, h: checkpoint(b, h, policy=POLICIES[policy]))
    _assert_bitwise(grads, ref)
    assert loss == loss_ref


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_full_recomputation_equals_torch_checkpoint_non_reentrant(dropout):
    cfg = get_config("nano", dropout=dropout, n_head=4)
    ours, ours_flops, _ = _blocks_step(cfg, lambda b, h: checkpoint(b, h))
    theirs, their_flops, _ = _blocks_step(cfg, lambda b, h: torch_checkpoint(b, h, use_reentrant=False))
    _assert_bitwise(ours, theirs)
    fc_out = 2 * 3 * cfg.seq_len * cfg.mlp_ratio * cfg.d_model ** 2 * cfg.n_layer
    # both stop after the last tensor backward needs; with dropout torch reruns each block's fc_out to reach the
    # MLP dropout mask, which we rebuild from its shape alone (empty_like reads no values)
    assert their_flops == ours_flops + (fc_out if dropout else 0)


@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("policy", ["selective", "all_but_matmuls"])
def test_selective_equals_torch_selective_checkpointing_with_the_same_policy(policy, dropout):
    cfg = get_config("nano", dropout=dropout)
    ours, ours_flops, _ = _blocks_step(cfg, lambda b, h: checkpoint(b, h, policy=POLICIES[policy]))
    theirs, their_flops, _ = _blocks_step(cfg, _torch_sac(POLICIES[policy]))
    _assert_bitwise(ours, theirs)
    B, T, d, L = 3, cfg.seq_len, cfg.d_model, cfg.n_layer
    if policy == "selective":     # we rerun QKᵀ only (A·V's output is kept downstream); torch reruns A·V too
        assert (ours_flops, their_flops) == (2 * B * T * T * d * L, 4 * B * T * T * d * L)
    else:
        assert ours_flops == their_flops == 0


def test_recomputed_dropout_mask_is_the_forward_mask_and_the_rng_stream_continues():
    cfg = get_config("nano", dropout=0.5)
    block = GPT(cfg).blocks[0]
    x = torch.randn(2, cfg.seq_len, cfg.d_model, requires_grad=True)
    torch.manual_seed(7)
    checkpoint(block, x).sum().backward()
    after_ours = torch.rand(3)
    torch.manual_seed(7)
    block(x).sum()
    after_plain = torch.rand(3)
    assert torch.equal(after_ours, after_plain), "the rerun must leave the generator where forward left it"


# ------------------------------------------------------------------------------------------- bad input
def test_a_random_op_without_rng_restore_is_refused_where_torch_silently_differs():
    cfg = get_config("nano", dropout=0.3)
    ref, _, _ = _blocks_step(cfg, _plain)
    silent, _, _ = _blocks_step(cfg, lambda b, h: torch_checkpoint(b, h, use_reentrant=False,
                                                                  preserve_rng_state=False))
    assert any(not torch.equal(silent[n], ref[n]) for n in ref), "without the RNG state the masks differ"
    with pytest.raises(CheckpointError, match=r"random op aten\.bernoulli_.*preserve_rng_state=True"):
        _blocks_step(cfg, lambda b, h: checkpoint(b, h, preserve_rng_state=False))


def test_without_dropout_rng_restore_may_be_off():
    cfg = get_config("nano")
    ref, _, _ = _blocks_step(cfg, _plain)
    _assert_bitwise(_blocks_step(cfg, lambda b, h: checkpoint(b, h, preserve_rng_state=False))[0], ref)


def test_a_forward_that_depends_on_global_state_is_caught_in_the_rerun():
    state = {"scale": True}

    def fn(x):
        y = x.sin()
        return (y * 2 if state["scale"] else y + 2).exp()
    x = torch.randn(5, requires_grad=True)
    out = checkpoint(fn, x)
    state["scale"] = False
    with pytest.raises(CheckpointError, match="must depend only on its inputs"):
        out.sum().backward()


def test_an_input_changed_in_place_after_forward_is_caught():
    x = torch.randn(5, requires_grad=True)
    h = x * 1
    out = checkpoint(lambda t: t.sin().cos(), h)
    with torch.no_grad():
        h.add_(1)
    with pytest.raises(CheckpointError, match="changed in place"):
        out.sum().backward()


def test_an_in_place_update_of_an_outside_tensor_is_refused():
    buf = torch.zeros(5)
    with pytest.raises(CheckpointError, match="in place"):
        checkpoint(lambda t: buf.add_(t.detach()) + t.sin(), torch.randn(5, requires_grad=True))


def test_segments_do_not_nest_and_a_failing_block_leaves_none_open():
    x = torch.randn(4, requires_grad=True)
    with pytest.raises(CheckpointError, match="cannot nest"):
        checkpoint(lambda t: checkpoint(torch.sin, t), x)
    model = apply_recompute(GPT("nano"), policy="every", k=2)
    with pytest.raises(ValueError, match="longer than"):
        model(torch.zeros(1, 65, dtype=torch.long))
    with pytest.raises(RuntimeError):            # raised inside block 0, with the segment of blocks 0–1 open
        model.blocks[0](torch.randn(2, 8, 33))
    out = checkpoint(torch.sin, x)               # nothing left open
    out.sum().backward()
    assert torch.allclose(x.grad, x.detach().cos())


@pytest.mark.parametrize("bad, match", [
    (dict(policy="sometimes"), "unknown recomputation policy"),
    (dict(policy="every"), "needs k"),
    (dict(policy="every", k=0), "needs k"),
    (dict(policy="full", k=2), "takes no k"),
    (dict(policy=make_plan("full", 3)), "covers 3 blocks"),
])
def test_apply_recompute_rejects_bad_policies_with_the_fix(bad, match):
    with pytest.raises(ValueError, match=match):
        apply_recompute(GPT("nano"), **bad)


def test_plans_must_cover_every_block_once():
    with pytest.raises(ValueError, match="without gaps"):
        RecomputePlan([Unit(0, 1, "store"), Unit(2, 3, "full")])
    with pytest.raises(ValueError, match="one block"):
        Unit(0, 2, "selective")
    assert str(make_plan("sqrt", 9)) == "[F F F] [F F F] [F F F]" and str(make_plan("every", 5, k=2)) == \
        "[F F] [F F] [F]"


def test_budget_below_the_minimum_is_an_error_naming_the_minimum():
    costs = formula_costs(get_config("micro"), 2)
    smallest = min_budget(costs)
    with pytest.raises(ValueError, match=f"below the minimum of {smallest:,} bytes"):
        optimal_plan(costs, smallest - 1)
    assert plan_peak(optimal_plan(costs, smallest).plan, costs) == smallest
    for bad in (0, -5, 1.5, True):
        with pytest.raises(ValueError, match="positive number of bytes"):
            optimal_plan(costs, bad)


# ------------------------------------------------------------------------------------------- the model
def test_apply_recompute_keeps_names_and_can_be_replaced_or_removed():
    model = GPT("nano")
    names = [n for n, _ in model.named_parameters()]
    apply_recompute(model, policy="selective")
    apply_recompute(model, policy="full")
    assert [n for n, _ in model.named_parameters()] == names and str(handle_of(model, "recompute")) == "[F] [F]"
    n_hooks = sum(len(b._forward_pre_hooks) + len(b._forward_hooks) for b in model.blocks)
    assert n_hooks == 4
    remove_recompute(model)
    assert handle_of(model, "recompute") is None
    assert not any(b._forward_pre_hooks or b._forward_hooks for b in model.blocks)


class _Wrapper(torch.nn.Module):
    """A wrapper the way DDP is one: the model it runs is `.module`."""

    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, *args):
        return self.module(*args)


def test_apply_recompute_changes_the_model_in_place_and_reaches_through_wrappers():
    assert RecomputePlan is RecomputePlan
    model = GPT("nano")
    assert apply_recompute(model, policy="full") is model
    wrapped = _Wrapper(GPT("nano"))
    assert apply_recompute(wrapped, policy="every", k=2) is wrapped and str(handle_of(wrapped, "recompute")) == "[F F]"
    assert all(b._forward_hooks for b in wrapped.module.blocks)
    x = torch.randint(0, 256, (2, 64))
    _, loss = wrapped(x, x.roll(1, 1))
    loss.backward()
    ref = GPT("nano")
    ref(x, x.roll(1, 1))[1].backward()
    _assert_bitwise({n: p.grad for n, p in wrapped.module.named_parameters()},
                    {n: p.grad for n, p in ref.named_parameters()})


def test_a_model_without_blocks_is_refused_naming_what_to_pass():
    with pytest.raises(TypeError, match="apply_recompute: Linear has no transformer blocks.*pass the course GPT"):
        apply_recompute(torch.nn.Linear(3, 3))


def test_a_recomputed_tensor_is_handed_back_once():
    x = torch.randn(4, requires_grad=True)
    y = checkpoint(lambda t: t.sin().exp(), x)
    y.sum().backward(retain_graph=True)
    with pytest.raises(CheckpointError, match="unpacked twice"):
        y.sum().backward()


def test_recomputation_and_activation_offload_refuse_the_same_blocks_in_either_order():
    """Recomputation replays a block in backward, when offload has already moved what it saved: the two are
    alternatives for one block, and each refuses a model the other holds, with the fix (ParallelPlan.check refuses
    the combination before launch too)."""
    from course_lib.memopt.offload import ActivationOffload
    cfg = get_config("nano")
    with pytest.raises(ValueError, match="offload or recompute a block, not both"):
        ActivationOffload(apply_recompute(GPT(cfg, seed=0), policy="full"))
    offloaded = ActivationOffload(GPT(cfg, seed=0))
    try:
        with pytest.raises(ValueError, match="offload or recompute a block, not both"):
            apply_recompute(offloaded, policy="selective")
        with pytest.raises(ValueError, match="offload or recompute a block, not both"):
            apply_recompute(offloaded.module, policy="selective")
        assert handle_of(offloaded.module, "activation_offload") is not None
    finally:
        offloaded.close()


def _peak(cfg, wrap, whole_model: bool) -> int:
    """The device peak the memory accountant sees over one forward and backward (B = 8): one block of nano, or the
    whole model, with each block passed through wrap(block, h)."""
    model = GPT(cfg, seed=0)
    g = torch.Generator().manual_seed(0)
    with MemoryTracker().watch(model) as mem:
        if whole_model:
            x = torch.randint(0, cfg.vocab_size, (8, cfg.seq_len), generator=g)
            torch.manual_seed(1)
            h = model.embed(x)
            for block in model.blocks:
                h = wrap(block, h)
            lm_loss(model.head(h), x.roll(1, 1)).backward()
        else:
            h = torch.randn(8, cfg.seq_len, cfg.d_model, generator=g).requires_grad_()
            torch.manual_seed(1)
            out = wrap(model.blocks[0], h)
            out.backward(torch.ones_like(out))
    return mem.peak


@pytest.mark.parametrize("whole_model", [False, True])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("policy", ["full", "selective", "all_but_matmuls"])
def test_the_peak_is_never_above_torch_checkpoint_with_the_same_policy(policy, dropout, whole_model):
    """Each kept tensor is let go once the rerun has handed it back, each recomputed one once autograd has it: the
    peak equals torch's where both keep the same tensors (full recomputation; all_but_matmuls on a block whose
    fc_out output a recomputed op reads, dropout on) and is below it where torch caches more (every output its
    policy keeps: without dropout, fc_out's, which nothing reads in the rerun)."""
    cfg = get_config("nano", dropout=dropout)
    ours = _peak(cfg, lambda b, h: checkpoint(b, h, policy=POLICIES[policy]), whole_model)
    theirs = _peak(cfg, (lambda b, h: torch_checkpoint(b, h, use_reentrant=False)) if policy == "full"
                   else _torch_sac(POLICIES[policy]), whole_model)
    assert ours <= theirs
    if policy == "full":
        assert ours == theirs
    if policy == "all_but_matmuls" and not whole_model:
        fc_out = 4 * 8 * cfg.seq_len * cfg.d_model
        assert ours == theirs - (0 if dropout else fc_out)


def test_no_grad_and_eval_run_without_segments():
    model = apply_recompute(GPT(get_config("nano", dropout=0.1)), policy="full")
    x = torch.randint(0, 256, (2, 64))
    model.eval()
    with MemoryTracker().watch(model) as mem:
        with torch.no_grad():
            logits, _ = model(x)
        assert mem.current["activations"] == 0
    assert torch.equal(logits, GPT(get_config("nano", dropout=0.1)).eval()(x)[0])


def _measure(cfg, plan, batch, seed=0):
    model = GPT(cfg, seed=seed)
    if plan is not None:
        apply_recompute(model, policy=plan)
    torch.manual_seed(seed)
    r = run(model, optim.build(model, **optimizer_kwargs(TrainConfig())), ShardedBatches(cfg.seq_len, batch, seed=seed),
            steps=1, probes=[MemoryProbe(), FlopProbe(), GradProbe()])
    flops = r["flops"][0]
    return activation_peak(r["memory"]["report"]), flops["backward"] - 2 * flops["forward"], r["grads"], r.losses


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_every_plan_peak_and_flops_equal_the_formula_through_the_training_loop(dropout):
    cfg = get_config("micro", n_layer=5, dropout=dropout, seq_len=48)
    costs = formula_costs(cfg, 2)
    peak, extra, ref, losses = _measure(cfg, None, 2)
    assert (peak, extra) == (activation_bytes(cfg, 2), 0) == (plan_peak(make_plan("none", 5), costs), 0)
    mixed = RecomputePlan([Unit(0, 1, "selective"), Unit(1, 3, "full"), Unit(3, 4, "store"), Unit(4, 5, "full")])
    plans = [make_plan(p, 5) for p in ("full", "sqrt", "selective")] + [make_plan("every", 5, k=2), mixed]
    for plan in plans:
        peak, extra, grads, plan_losses = _measure(cfg, plan, 2)
        assert (peak, extra) == (plan_peak(plan, costs), plan_extra(plan, costs)), str(plan)
        _assert_bitwise(grads, ref)
        assert plan_losses == losses


@pytest.mark.parametrize("name, overrides", [("micro", dict(n_layer=2)), ("nano", dict(dropout=0.2, n_head=4)),
                                             ("mini", dict(n_layer=1, seq_len=40, tie_weights=True))])
def test_measured_costs_equal_the_closed_forms(name, overrides):
    cfg = get_config(name, **overrides)
    measured, formula = measure_costs(cfg, 2, repeats=1), formula_costs(cfg, 2)
    assert (measured.embed, measured.head) == (formula.embed, formula.head)
    for m, f in zip(measured.blocks, formula.blocks):
        for field in ("saved", "input", "selective_held", "selective_work", "fwd_flops", "full_flops",
                      "selective_flops"):
            assert getattr(m, field) == getattr(f, field), field
    assert formula.blocks[0].saved == block_activation_bytes(cfg, 2)
    assert formula.embed + sum(b.saved for b in formula.blocks) + formula.head == activation_bytes(cfg, 2)


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_dropout_masks_are_counted_exactly(dropout):
    cfg = get_config("micro", n_layer=2, dropout=dropout, seq_len=50)
    m = GPT(cfg)
    x, y = torch.randint(0, 256, (3, 50)), torch.randint(0, 256, (3, 50))
    with MemoryTracker().watch(m) as mem:
        _, loss = m(x, y)
        assert mem.current["activations"] == activation_bytes(cfg, 3)
    with MemoryTracker().watch(m) as mem:
        out = m.blocks[0](torch.randn(3, 50, cfg.d_model))
        assert mem.current["activations"] == block_activation_bytes(cfg, 3)
    del loss, out


# ------------------------------------------------------------------------------------------- torch's MemTracker
def _forward_under_both(wrap):
    """Forward of nano (B=8) with each block through wrap, under our accountant and torch's MemTracker at once;
    ({storage: bytes} MemTracker calls activations, {storage: (bytes, our category)}, our current bytes)."""
    from torch.distributed._tools.mem_tracker import MemTracker
    model = GPT("nano")
    opt = optim.build(model, **optimizer_kwargs(TrainConfig()))
    x, y = torch.randint(0, 256, (8, 64)), torch.randint(0, 256, (8, 64))
    theirs = MemTracker()
    theirs.track_external(model, opt)
    with MemoryTracker().watch(model, opt) as mem, theirs:
        h = model.embed(x)
        for block in model.blocks:
            h = wrap(block, h)
        loss = lm_loss(model.head(h), y)
        act = {st._cdata: info[0].mem_consumed for st, info in theirs._WINFO.items() if "ACT" in str(info[0].reftype)}
        ours = {k: (v[0], v[1]) for k, v in mem._live.items() if isinstance(k, int)}
        current = dict(mem.current)
        loss.backward()
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())    # MemTracker's own category
    return act, ours, current, (x.untyped_storage()._cdata, buffers)


@pytest.mark.parametrize("policy", ["none", "full", "selective", "all_but_matmuls"])
def test_torch_memtracker_sees_the_same_storages(policy):
    """Storage by storage, what MemTracker calls activations is one of our activations or others (logits, loss), and
    the only activation it may miss is the token-id tensor created before tracking (it sees it when autograd saves
    it through our detached alias) — as for the plain model in test_memory.py. With full recomputation our bytes
    equal torch's checkpoint's; with a selective policy torch keeps more: it caches the output of every op the
    policy keeps, we only what autograd saves (all_but_matmuls: exactly each block's fc_out output)."""
    wrap = _plain if policy == "none" else lambda b, h: checkpoint(b, h, policy=POLICIES[policy])
    act, ours, current, (ids, buffers) = _forward_under_both(wrap)
    assert act and all(k in ours and ours[k][1] in ("activations", "other") and ours[k][0] == n for k, n in act.items())
    missed = {k for k, (n, cat) in ours.items() if cat == "activations" and k not in act}
    assert missed <= {ids}
    assert sum(act.values()) == current["activations"] + current["other"] - buffers - sum(ours[k][0] for k in missed)
    if policy == "none":
        return
    theirs, _, _, _ = _forward_under_both(lambda b, h: torch_checkpoint(b, h, use_reentrant=False) if policy == "full"
                                          else _torch_sac(POLICIES[policy])(b, h))
    cfg = get_config("nano")
    fc_out = 2 * 8 * 64 * cfg.d_model * 4
    extra = {"full": 0, "all_but_matmuls": fc_out}.get(policy)
    if extra is None:
        assert sum(theirs.values()) > sum(act.values())
    else:
        assert sum(theirs.values()) == sum(act.values()) + extra


# ------------------------------------------------------------------------------------------- the optimum
def _all_plans(n):
    """Every plan of n blocks: a plan of the first `start` blocks, then one unit ending at block n."""
    if n == 0:
        yield ()
        return
    for start in range(n):
        for head in _all_plans(start):
            kinds = ["full"] if n - start > 1 else ["store", "selective", "full"]
            for kind in kinds:
                yield head + (Unit(start, n, kind),)


@pytest.mark.parametrize("name, overrides", [("micro", dict(n_layer=6)), ("mini", dict(n_layer=5, dropout=0.1))])
def test_the_dynamic_program_finds_the_brute_force_optimum_at_every_budget(name, overrides):
    cfg = get_config(name, **overrides)
    costs = formula_costs(cfg, 2)
    plans = [RecomputePlan(units) for units in _all_plans(cfg.n_layer)]
    assert len(plans) == len({str(p) for p in plans})
    scored = [(plan_peak(p, costs), plan_extra(p, costs), p) for p in plans]
    front = pareto_front(costs)
    brute = []
    for peak, extra, _ in sorted(scored, key=lambda s: (s[0], s[1])):
        if not brute or extra < brute[-1][1]:
            brute.append((peak, extra))
    assert [(c.peak, c.extra) for c in front] == brute
    assert min_budget(costs) == min(s[0] for s in scored)
    for budget in sorted({s[0] for s in scored})[::3]:
        best = optimal_plan(costs, budget)
        assert best.extra == min(e for p, e, _ in scored if p <= budget)
        assert best.peak == plan_peak(best.plan, costs) <= budget and best.extra == plan_extra(best.plan, costs)
    for named in ("full", "sqrt", "selective"):               # never worse than a rule of thumb at its own peak
        plan = make_plan(named, cfg.n_layer)
        assert optimal_plan(costs, plan_peak(plan, costs)).extra <= plan_extra(plan, costs)


def test_the_optimum_by_measured_seconds_fits_the_budget():
    cfg = get_config("nano", n_layer=3)
    costs = measure_costs(cfg, 2, repeats=1)
    budget = plan_peak(make_plan("selective", 3), costs)
    best = optimal_plan(costs, budget, cost="seconds")
    assert best.peak <= budget and best.extra == plan_extra(best.plan, costs, "seconds") >= 0
    with pytest.raises(ValueError, match="'flops' or 'seconds'"):
        optimal_plan(costs, budget, cost="joules")


# ------------------------------------------------------------------------------------------- a pipeline stage
def _stage_step(stage, x, policy, seed=0):
    """One forward and backward of a middle pipeline stage on the activation x, under the memory accountant:
    (gradients, activations held after forward, activation peak)."""
    if policy is not None:
        apply_recompute(stage, policy=policy)
    h = x.clone().requires_grad_()
    torch.manual_seed(seed)
    with MemoryTracker().watch(stage) as mem:
        out = stage(h)
        held = mem.current["activations"]
        out.backward(torch.ones_like(out))
    peak = max(s["device"].get("activations", 0) + s["device"].get("recomputed", 0) for _, s in mem.timeline)
    return {"input": h.grad, **{n: p.grad for n, p in stage.named_parameters()}}, held, peak


@pytest.mark.parametrize("policy", ["full", "selective", "every"])
def test_apply_recompute_on_a_pipeline_stage_recomputes_only_its_blocks(policy):
    """A PipelineStage holds some of the GPT's blocks (a ModuleDict keyed by their index): the plan covers those, the
    gradients are bitwise those without recomputation (dropout on) and the bytes are the stage chain's formulas."""
    from course_lib.memopt.recompute.costs import plan_held
    from course_lib.memopt.recompute.pipeline import stage_chain
    from course_lib.parallel.pipeline import PipelineStage, split_layers
    cfg = get_config("nano", n_layer=5, seq_len=16, dropout=0.1)
    bounds = split_layers(5, 3)                                   # the middle stage runs blocks 2 and 3
    x = torch.randn(2, cfg.seq_len, cfg.d_model, generator=torch.Generator().manual_seed(0))
    plain, held_plain, _ = _stage_step(PipelineStage(GPT(cfg), [1], bounds, 3), x, None)
    stage = PipelineStage(GPT(cfg), [1], bounds, 3)
    plan = make_plan(policy, 2, k=2 if policy == "every" else None)
    grads, held, peak = _stage_step(stage, x, plan)
    chain = stage_chain(formula_costs(cfg, 2), bounds, 1)
    assert handle_of(stage, "recompute") == plan and chain.embed == chain.head == 0 and len(chain.blocks) == 2
    assert all(torch.equal(grads[k], plain[k]) for k in plain)
    assert held == plan_held(plan, chain) and peak == plan_peak(plan, chain)
    assert held_plain == plan_held(make_plan("none", 2), chain) == 2 * block_activation_bytes(cfg, 2)


def test_a_segment_may_not_span_two_stages_of_an_interleaved_rank():
    from course_lib.parallel.pipeline import PipelineStage, split_layers
    bounds = split_layers(4, 4)                                    # 2 ranks × 2 chunks of one block
    stage = PipelineStage(GPT(get_config("nano", n_layer=4)), [0, 2], bounds, 4)    # rank 0: blocks 0 and 2
    with pytest.raises(ValueError, match="spans two pipeline stages"):
        apply_recompute(stage, policy="every", k=2)
    assert str(handle_of(apply_recompute(stage, policy="full"), "recompute")) == "[F] [F]"


def test_pipeline_peaks_are_m_minus_1_held_plus_one_working_set():
    """The closed form by hand for 1F1B on 3 stages (m = 3, 2, 1 in flight) and GPipe (m = M), full recomputation:
    held = E + n·4bTd (+ H on the last stage), work = E + (n − 1)·4bTd + s (or held, if larger); no recomputation:
    (m)·stage_activation_bytes."""
    from course_lib.memopt.recompute.pipeline import max_in_flight, pipeline_peaks
    from course_lib.parallel.pipeline import make_schedule, split_layers, stage_activation_bytes
    cfg = get_config("nano", n_layer=5, seq_len=16, dropout=0.1)
    b, S, M = 2, 3, 7
    costs, bounds = formula_costs(cfg, b), split_layers(5, S)       # blocks 2, 2, 1
    E, H, a, s = costs.embed, costs.head, 4 * b * cfg.seq_len * cfg.d_model, block_activation_bytes(cfg, b)
    n = [e - st for st, e in bounds]
    held = [E + n[0] * a, n[1] * a, n[2] * a + H]
    work = [max(held[k], (E if k == 0 else 0) + (n[k] - 1) * a + s) for k in range(S)]
    one_f = make_schedule("1f1b", S, M)
    assert pipeline_peaks(one_f, bounds, costs, "full") == [(S - k - 1) * held[k] + work[k] for k in range(S)]
    assert pipeline_peaks(make_schedule("gpipe", S, M), bounds, costs, "full") == \
        [(M - 1) * held[k] + work[k] for k in range(S)]
    units = [stage_activation_bytes(cfg, bounds, k, b) for k in range(S)]
    assert pipeline_peaks(one_f, bounds, costs, "none") == [(S - k) * units[k] for k in range(S)]
    budget = 2 * held[1] + work[1]
    assert max_in_flight(budget, held[1], work[1]) == 3 and max_in_flight(budget - 1, held[1], work[1]) == 2
    assert max_in_flight(work[1] - 1, held[1], work[1]) == 0


def test_the_activation_peak_probe_gives_the_reports_activation_peak():
    from course_lib.memopt.recompute.measured import ActivationPeakProbe
    cfg = get_config("nano", seq_len=16, dropout=0.1)
    peaks = []
    for probe in (MemoryProbe(), ActivationPeakProbe()):
        model = apply_recompute(GPT(cfg), policy="full")
        torch.manual_seed(0)
        r = run(model, optim.build(model, **optimizer_kwargs(TrainConfig())), ShardedBatches(cfg.seq_len, 2), steps=1,
                probes=[probe])
        peaks.append(r[probe.name] if probe.name != "memory" else activation_peak(r["memory"]["report"]))
    assert peaks[0] == peaks[1] == plan_peak(make_plan("full", cfg.n_layer), formula_costs(cfg, 2))
