"""The swap planner: its trace agrees with the memory accountant, its memory model with the accountant running the
plan, every plan gives the reference gradients, and bad budgets and plans are refused (docs/formulas.md §6.5)."""
import dataclasses

import numpy as np
import pytest
import torch

from course_lib.core.costmodel import get_link
from course_lib.core.data import ShardedBatches
from course_lib.core.model import GPT, get_config
from course_lib.memopt import swap_planner as SP
from course_lib.memory import MemoryTracker, SimulatedOutOfMemoryError

torch.set_num_threads(1)
CFG = get_config("nano", n_layer=3)
BATCH = ShardedBatches(CFG.seq_len, 4).global_batch(0)
LINK = get_link("PCIe Gen4 x16")


def _stated(trace, seconds_per_op):
    """The trace with stated op costs instead of the measured ones: what depends on time is then fixed by
    construction (memory, bytes and gradients never depend on op times)."""
    return dataclasses.replace(trace, ops=[(name, seconds_per_op) for name, _ in trace.ops])


@pytest.fixture(scope="module")
def trace():
    return _stated(SP.trace_step(GPT(CFG), BATCH), 1e-6)      # 1 µs per op: the seeded search is deterministic


@pytest.fixture(scope="module")
def reference():
    m = GPT(CFG)
    with MemoryTracker().watch(m) as mem:
        _, loss = m(*BATCH)
        loss.backward()
        del loss
    return {k: p.grad.clone() for k, p in m.named_parameters()}, mem.peak


def _speedup(trace):
    """The device speed at which moving every swappable byte once takes as long as the step's compute."""
    return trace.compute_seconds / LINK.time(sum(c.nbytes for c in trace.candidates))


def test_the_trace_reconstructs_the_accountants_peak_without_swapping(trace, reference):
    _, peak = reference
    assert trace.peak == peak
    assert trace.candidates and all(c.saved and c.drop < c.need <= c.release for c in trace.candidates)
    assert all(c.last_use <= c.drop for c in trace.candidates)       # read only while the forward held it
    assert sum(1 for s in trace.storages if s.category == "parameters") == len(list(GPT(CFG).parameters()))


@pytest.mark.parametrize("name", ["no offload", "swap everything", "least memory", "greedy", "genetic"])
def test_a_plan_runs_at_its_modeled_peak_without_running_out_and_gives_the_reference_gradients(trace, reference,
                                                                                                name):
    ref, peak = reference
    s = _speedup(trace)
    budget = (SP.minimum_budget(trace) + peak) // 2
    plan = {"no offload": SP.no_swap(), "swap everything": SP.swap_all(trace, LINK, speedup=s),
            "least memory": SP.least_memory(trace), "greedy": SP.greedy(trace, budget, LINK, speedup=s),
            "genetic": SP.genetic(trace, budget, LINK, speedup=s, generations=10)}[name]
    out = SP.simulate(trace, plan, LINK, speedup=s)
    got = SP.execute(GPT(CFG), BATCH, trace, plan, out.peak, LINK, speedup=s)      # the capacity is the model's peak
    assert got["peak"] == out.peak
    assert np.array_equal(got["at_op"][1:], out.memory[1:])                        # op by op (op 0: the token ids
    assert all(torch.equal(ref[k], got["grads"][k]) for k in ref)                  # are counted from its start)
    assert got["d2h"] == got["h2d"] == out.moved == sum(c.nbytes for c in trace.candidates
                                                        if c.id in plan.prefetch)
    if name in ("greedy", "genetic"):
        assert out.peak <= budget


def test_the_least_memory_plan_reaches_the_minimum_budget_and_nothing_goes_below(trace):
    low = SP.minimum_budget(trace)
    assert SP.simulate(trace, SP.least_memory(trace), LINK).peak == low < trace.peak
    with pytest.raises(ValueError, match="below the least this step can run in"):
        SP.greedy(trace, low - 1, LINK)
    with pytest.raises(ValueError, match=f"Give at least {low:,} bytes"):
        SP.genetic(trace, low - 1, LINK)


def test_the_search_is_never_worse_than_the_baselines_and_beats_greedy_somewhere(trace):
    s = _speedup(trace)
    low, high = SP.minimum_budget(trace), trace.peak
    better = 0
    for budget in np.linspace(low, high, 5).astype(int)[1:-1]:
        g, ga = SP.greedy(trace, int(budget), LINK, speedup=s), SP.genetic(trace, int(budget), LINK, speedup=s)
        assert ga is not None and SP.simulate(trace, ga, LINK, speedup=s).peak <= budget
        if g is not None:
            tg = SP.simulate(trace, g, LINK, speedup=s).seconds
            tga = SP.simulate(trace, ga, LINK, speedup=s).seconds
            assert tga <= tg
            better += tga < tg
    assert better >= 1


def test_a_plan_that_names_a_tensor_outside_the_trace_is_refused(trace):
    cid = trace.candidates[0].id
    with pytest.raises(ValueError, match="not storages of this trace"):
        SP.SwapPlan({"9999:0": 1}, {"9999:0": 2}, "typo").validate(trace)
    param = next(s for s in trace.storages if s.category == "parameters")
    with pytest.raises(ValueError, match="cannot be swapped"):
        SP.SwapPlan({param.id: 1}, {param.id: 2}, "params").validate(trace)
    c = trace.candidates[0]
    with pytest.raises(ValueError, match="drop ≤ release < prefetch < need"):
        SP.SwapPlan({cid: c.drop}, {cid: c.need + 1}, "late").validate(trace)
    with pytest.raises(ValueError, match="both a release and a prefetch"):
        SP.SwapPlan({cid: c.drop}, {}, "half").validate(trace)


def test_below_the_plans_peak_the_simulated_accelerator_runs_out(trace):
    plan = SP.least_memory(trace)
    peak = SP.simulate(trace, plan, LINK).peak
    with pytest.raises(SimulatedOutOfMemoryError):
        SP.execute(GPT(CFG), BATCH, trace, plan, peak - 1, LINK)


def test_swapping_costs_modeled_time_only_when_the_link_cannot_keep_up(trace):
    """Stated op costs, so each bound holds by construction. Every op longer than all the link's work: a transfer
    with at least one op to hide behind is hidden, so only a tensor let go right after the op that saved it (release
    = pack: the compute waits for its copy out at once) can stall, and swap-everything, which gives each transfer
    its own compute, never does. Ops that take no time: every copy back is waited for on the one h2d lane, so the
    stall is at least their sum."""
    total = sum(LINK.time(c.nbytes) for c in trace.candidates)
    budget = (SP.minimum_budget(trace) + trace.peak) // 2
    pack = {c.id: c.pack for c in trace.candidates}
    for cost in (2 * total, 0.0):
        t = _stated(trace, cost)
        for plan in (SP.least_memory(t), SP.swap_all(t, LINK), SP.greedy(t, budget, LINK)):
            o = SP.simulate(t, plan, LINK)
            moved = sum(LINK.time(c.nbytes) for c in t.candidates if c.id in plan.prefetch)
            assert moved > 0
            if cost:
                exposed = sum(LINK.time(c.nbytes) for c in t.candidates
                              if c.id in plan.prefetch and plan.release[c.id] == pack[c.id])
                assert o.stall <= exposed * (1 + 1e-12) and o.seconds == pytest.approx(t.compute_seconds + o.stall)
                if plan.name == "swap everything":
                    assert exposed == 0 and o.stall == 0.0
            else:
                assert o.stall >= moved * (1 - 1e-12) and o.seconds == o.stall
    none = SP.simulate(trace, SP.no_swap(), LINK)
    assert none.stall == 0 and none.seconds == pytest.approx(trace.compute_seconds, rel=1e-12)
