"""Mobius (course_lib.memopt.offload.mobius: model, executor, cluster): stages in host memory, the next one
prefetched; the gradients, the device peak, the bytes per step and the partition search against their closed forms
(docs/formulas.md §14.1, §14.2)."""
import pytest
import torch

from course_lib.core.costmodel import Link, get_link
from course_lib.core.model import GPT, GPTConfig
from course_lib.memopt.offload import mobius as MB
from course_lib.memopt.offload.mobius import cluster as MC
from course_lib.memory import SimulatedAccelerator, SimulatedOutOfMemoryError

CFG = GPTConfig(vocab_size=2048, seq_len=16, n_layer=4, n_head=2, d_model=32)   # embedding and head ≫ a block
B, M = 1, 2


def _batches():
    return MB.random_batches(CFG, M, B)


def _reference(batches):
    return MB.reference_step(CFG, batches)


FINE = [(u, u + 1) for u in range(CFG.n_layer + 2)]


def test_gradients_bitwise_bytes_and_state_peaks_equal_their_formulas():
    batches = _batches()
    ref = _reference(batches)
    model = GPT(CFG, seed=0)
    P = MB.stage_sums(MB.unit_bytes(model), FINE)
    budget = MB.states_peak(P) + max(MB.stage_sums(MB.unit_activation_bytes(CFG, B, M), FINE))
    assert budget < 2 * sum(P), "the budget must be smaller than the model's parameters and gradients"
    with SimulatedAccelerator(budget).track() as mem:
        ex = MB.MobiusExecutor(model, FINE, device_bytes=budget)       # the parameters go to the host first
        mem.watch(model)                                                # then the gradient hooks label gradients
        ex.step(batches)
    assert mem.peak <= budget
    peaks = MB.state_peaks(P)
    assert mem.max_by_category["parameters"] == peaks["parameters"]
    assert mem.max_by_category["gradients"] == peaks["gradients"]
    want = MB.mobius_bytes(P, M, 4 * B * CFG.seq_len * CFG.d_model)
    assert ex.log.bytes_recv(op="h2d") == want["h2d"] and ex.log.bytes_sent(op="d2h") == want["d2h"]
    ex.restore()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad), name


def test_a_budget_smaller_than_one_stage_is_refused_before_anything_moves():
    model = GPT(CFG, seed=0)
    before = [p.detach().clone() for p in model.parameters()]
    small = 2 * MB.unit_bytes(model)[0] - 1
    with pytest.raises(ValueError, match="smaller than one stage: stage 0"):
        MB.MobiusExecutor(model, FINE, device_bytes=small)
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))


def test_the_run_ooms_on_the_simulated_device_when_two_stages_do_not_fit():
    model = GPT(CFG, seed=0)
    P = MB.stage_sums(MB.unit_bytes(model), FINE)
    with pytest.raises(SimulatedOutOfMemoryError):
        with SimulatedAccelerator(max(P) * 2).track():
            MB.MobiusExecutor(model, FINE).step(_batches())


def test_bad_bounds_are_refused():
    with pytest.raises(ValueError, match="contiguous"):
        MB.MobiusExecutor(GPT(CFG, seed=0), [(0, 2), (3, 6)])


def test_timeline_stated_costs_prefetch_hides_a_load_shorter_than_the_compute():
    link = get_link("PCIe Gen4 x16")
    P = [int(31.5e9 * 1e-3)] * 3                          # 1 ms loads (+ α)
    tl = MB.mobius_timeline(P, [2e-3] * 3, [4e-3] * 3, link=link)
    # only the first load and the last gradients are exposed
    assert tl.exposed == pytest.approx(link.time(P[0]) + link.time(P[0]), rel=1e-12)
    slow = MB.mobius_timeline(P, [2e-3] * 3, [4e-3] * 3, link=link, prefetch=False)
    assert slow.total == pytest.approx(tl.total + 4 * link.time(P[0]), rel=1e-12)


def test_search_beats_the_even_split_on_uneven_layers_with_stated_costs():
    model = GPT(CFG, seed=0)
    ub = MB.unit_bytes(model)
    flops = 1e12                                           # stated device rate: 2 FLOPs per parameter per token
    tokens = M * B * CFG.seq_len
    fwd = [2 * (b / 4) * tokens / flops for b in ub]
    fwd[0] = 0.0                                           # the embedding is a lookup: no FLOPs
    bwd = [3 * f for f in fwd]                             # recompute + backward
    link = Link("slow link", 0.0, 2e9)
    even = MB.even_partition(CFG.n_layer, 3)
    Pe = MB.stage_sums(ub, even)
    t_even = MB.mobius_timeline(Pe, MB.stage_sums(fwd, even), MB.stage_sums(bwd, even), link=link).total
    best = MB.search_partition(ub, fwd, bwd, 2 * sum(ub), link=link)
    assert best["tried"] == 2 ** (len(ub) - 1) and best["seconds"] < t_even
    again = MB.mobius_timeline(MB.stage_sums(ub, best["bounds"]), MB.stage_sums(fwd, best["bounds"]),
                               MB.stage_sums(bwd, best["bounds"]), link=link).total
    assert again == best["seconds"]


def test_mappings_place_adjacent_stages_and_contention_never_speeds_up():
    topo = MC.Topology(8, 2)
    seq, cross = MC.sequential_mapping(8, topo), MC.cross_mapping(8, topo)
    assert sorted(cross) == list(range(8))
    assert all(topo.switch(a) == topo.switch(b) for a, b in zip(seq[0::2], seq[1::2]))
    assert all(topo.switch(a) != topo.switch(b) for a, b in zip(cross, cross[1:]))
    P, f = [1e9] * 16, [5e-3] * 16
    alone = MC.mobius_cluster_time(P, f, [2 * x for x in f], 4, MC.Topology(8, 1),
                                   MC.sequential_mapping(16, MC.Topology(8, 1)))
    shared = MC.mobius_cluster_time(P, f, [2 * x for x in f], 4, topo, MC.sequential_mapping(16, topo))
    assert shared["seconds"] >= alone["seconds"]


def test_zero3_offload_moves_twice_the_parameters_per_micro_batch_per_gpu():
    topo = MC.Topology(8, 2)
    r = MC.zero3_offload_time(1e9, 0.01, 16, topo)
    assert r["h2d_per_gpu"] == 2 * 2 * 1e9
    assert r["comm"] == pytest.approx(4e9 / (31.5e9 / 2), rel=1e-12)
