import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from course_lib import optim
from course_lib.core.data import ShardedBatches
from course_lib.core.model import GPT, activation_bytes, block_activation_bytes, get_config
from course_lib.memory import (
    CATEGORIES,
    MemoryTracker,
    SimulatedAccelerator,
    SimulatedOutOfMemoryError,
    alloc_category,
    carry_tracking,
    fmt_bytes,
    parse_bytes,
    placed,
    register_category,
    saved_tensors_hooks_over,
)
from course_lib.train import TrainConfig, optimizer_kwargs, profile_training_memory


def _step(model, opt, B=2, T=None):
    T = T or model.config.seq_len
    x = torch.randint(0, 256, (B, T))
    y = torch.randint(0, 256, (B, T))
    model(x, y)[1].backward()
    opt.step()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_parameters_count_numel_times_element_size(dtype):
    m = GPT("nano").to(dtype)
    with MemoryTracker().watch(m) as mem:
        pass
    assert mem.current["parameters"] == (sum(p.numel() for p in m.parameters())
                                         * torch.tensor([], dtype=dtype).element_size())


def test_gradients_and_adamw_state_are_exact():
    m = GPT("nano")
    opt = optim.build(m, **optimizer_kwargs(TrainConfig()))
    params = list(m.parameters())
    psi, n = sum(p.numel() for p in params), len(params)
    with MemoryTracker().watch(m, opt) as mem:
        _step(m, opt)
    assert mem.current["gradients"] == 4 * psi
    assert mem.current["optimizer"] == 8 * psi + 4 * n          # exp_avg + exp_avg_sq + a 4-byte step per tensor


def test_sgd_momentum_state_is_one_buffer_per_parameter():
    m = GPT("nano")
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    with MemoryTracker().watch(m, opt) as mem:
        _step(m, opt)
    assert mem.current["optimizer"] == 4 * sum(p.numel() for p in m.parameters())


@pytest.mark.parametrize("name, B, T", [("nano", 4, 64), ("micro", 2, 100), ("mini", 1, 33)])
def test_one_block_saves_exactly_the_analytic_activation_bytes(name, B, T):
    cfg = get_config(name)
    block = GPT(cfg).blocks[0]
    h = torch.randn(B, T, cfg.d_model)
    with MemoryTracker().watch(block) as mem:
        out = block(h)
    assert mem.current["activations"] == block_activation_bytes(cfg, B, T)
    del out


@pytest.mark.parametrize("name, B, T", [("nano", 4, 64), ("micro", 3, 100)])
def test_whole_model_activations_and_their_release_by_backward(name, B, T):
    cfg = get_config(name)
    m = GPT(cfg)
    x, y = torch.randint(0, 256, (B, T)), torch.randint(0, 256, (B, T))
    with MemoryTracker().watch(m) as mem:
        _, loss = m(x, y)
        assert mem.current["activations"] == activation_bytes(cfg, B, T)
        loss.backward()
        del loss
        assert mem.current["activations"] == 0
    assert mem.max_by_category["activations"] == activation_bytes(cfg, B, T)


def test_profile_training_memory_matches_every_closed_form():
    report, psi, n = profile_training_memory("nano", 4, 32, timeline=True)
    m = report.max_by_category
    assert (m["parameters"], m["gradients"], m["optimizer"]) == (4 * psi, 4 * psi, 8 * psi + 4 * n)
    assert m["activations"] == activation_bytes(get_config("nano"), 4, 32)
    assert report.peak >= sum(report.peak_by_category[c] for c in ("parameters", "optimizer"))
    assert report.timeline and [label for _, label in report.marks][:3] == ["fwd 0", "bwd 0", "opt 0"]
    assert "peak total" in report.table()


def test_timeline_totals_are_consistent():
    report, _, _ = profile_training_memory("nano", 2, 16)
    assert max(sum(snap.values()) for _, snap in report.timeline) == report.peak


def test_alloc_category_labels_new_storage():
    with MemoryTracker() as mem:
        with alloc_category("comm"):
            buf = torch.empty(1000)
        tmp = torch.empty(10)
    assert mem.current["comm"] == 4000 and mem.current["other"] == 40
    del buf, tmp
    with pytest.raises(ValueError, match="unknown memory category"):
        with alloc_category("cache"):
            pass


def test_freed_storage_is_subtracted_and_views_are_not_double_counted():
    with MemoryTracker() as mem:
        a = torch.ones(256)
        v = a[10:]
        b = a.view(16, 16).t()
        assert mem.total == 1024
        del a, b
        assert mem.total == 1024     # the view still holds the storage
        del v
        assert mem.total == 0


def test_simulated_accelerator_raises_naming_the_largest_categories():
    acc = SimulatedAccelerator("2 MiB", name="toy GPU")
    m = GPT("nano")
    opt = optim.build(m, **optimizer_kwargs(TrainConfig()))
    with pytest.raises(SimulatedOutOfMemoryError) as err:
        with acc.track(m, opt):
            _step(m, opt, B=16)
    msg = str(err.value)
    assert "toy GPU" in msg and "modeled" in msg and "activations" in msg and "2.00 MiB" in msg
    assert "recompute" in msg


def test_simulated_accelerator_fits_predicts_by_capacity():
    def fits(cap):
        acc = SimulatedAccelerator(cap)

        def one_step():
            m = GPT("nano")
            opt = optim.build(m, **optimizer_kwargs(TrainConfig()))
            with acc.track(m, opt):
                _step(m, opt)
        return acc.fits(one_step)
    report, _, _ = profile_training_memory("nano", 2, 64, steps=1, timeline=False)
    assert fits(report.peak + 4096)      # the model's own tensors exist before tracking starts: a little slack
    assert not fits(report.peak // 2)
    with pytest.raises(ValueError):
        SimulatedAccelerator(0)


def test_parse_and_format_bytes():
    assert parse_bytes("8 MiB") == 8 * 2**20 and parse_bytes("1.5GB") == 1_500_000_000 and parse_bytes(12) == 12
    assert fmt_bytes(3 * 2**20) == "3.00 MiB" and fmt_bytes(10) == "10 B"
    with pytest.raises(ValueError, match="cannot read"):
        parse_bytes("lots")


def test_a_registered_category_labels_storage_and_an_unregistered_one_is_refused():
    with pytest.raises(ValueError, match="register_category"):
        with alloc_category("stashed weights (test)"):
            pass
    register_category("stashed weights (test)")
    assert "stashed weights (test)" in CATEGORIES
    with MemoryTracker() as mem:
        with alloc_category("stashed weights (test)"):
            w = torch.empty(300)
    assert mem.current["stashed weights (test)"] == 1200 and mem.max_by_category["stashed weights (test)"] == 1200
    del w


def test_placement_moves_bytes_off_the_device_and_the_accelerator_counts_only_the_device():
    with SimulatedAccelerator("4 KiB").track() as mem:
        a = torch.empty(768)                              # 3 KiB on the device
        with placed("host"):
            b = torch.empty(768)                          # 3 KiB on the host: does not count against 4 KiB
        mem.move(a, "host")                               # offload a: the device is empty again
        c = torch.empty(1000)                             # 4000 B fits now
        assert mem.total == 4000 and mem.total_at("host") == 6144
        assert mem.current_at("host")["other"] == 6144 and mem.peak == 4000
        mem.add_external("shard.bin", 10_000, "optimizer")
        assert mem.current_at("disk")["optimizer"] == 10_000
        mem.remove_external("shard.bin")
        assert mem.total_at("disk") == 0 and mem.peak_at("disk") == 10_000
        with pytest.raises(SimulatedOutOfMemoryError):
            mem.move(b, "device")                         # 4000 + 3072 > 4096
    report = mem.report()
    assert report.at("host")["peak"] == 6144 and report.at("disk")["peak"] == 10_000
    del a, b, c


def test_labels_are_per_thread_and_carried_threads_are_counted():
    """A communication thread allocating under alloc_category('comm') while the main thread allocates must not
    relabel the main thread's bytes, and a thread started with carry_tracking is seen by the tracker."""
    inside, go_on = threading.Event(), threading.Event()

    def comm_thread():
        with alloc_category("comm"):
            buf = torch.empty(500)
            inside.set()
            go_on.wait(10)
        return buf

    with MemoryTracker() as mem:
        with ThreadPoolExecutor(1) as pool:
            fut = pool.submit(carry_tracking(comm_thread))
            inside.wait(10)
            mine = torch.empty(100)                      # main thread, while the other is inside alloc_category
            go_on.set()
            theirs = fut.result()
    assert mem.current["comm"] == 2000 and mem.current["other"] == 400
    del mine, theirs


def test_saved_tensors_hooks_over_keeps_the_enclosing_tracker_counting():
    m = GPT("nano")
    x, y = torch.randint(0, 256, (2, 64)), torch.randint(0, 256, (2, 64))
    seen = []
    with MemoryTracker().watch(m) as mem:
        with saved_tensors_hooks_over(lambda t: seen.append(1) or t, lambda t: t):
            _, loss = m(x, y)
        assert seen and mem.current["activations"] == activation_bytes(m.config, 2, 64)
        loss.backward()
        del loss
        assert mem.current["activations"] == 0


def test_timeline_uses_the_ledgers_clock():
    t_before = time.perf_counter()
    report, _, _ = profile_training_memory("nano", 2, 16, steps=1)
    assert t_before <= report.t0 <= report.timeline[0][0] <= report.timeline[-1][0] <= time.perf_counter()
    assert all(t_before <= t for t, _ in report.marks)


def test_agrees_with_torch_memtracker_on_one_training_step():
    """An independent accountant on the same step: torch's MemTracker (torch.distributed._tools.mem_tracker, private
    API, exact on CPU). Model states must agree byte for byte. Activations are reconciled storage by storage: its
    'act' is every storage created in forward and still alive (logits and loss included); ours is what autograd
    saves for backward, plus 'other' for the rest. So every storage it calls 'act' is one of our activations or
    others, and the only activations it does not see are tensors created before tracking started (the token ids)."""
    from torch.distributed._tools.mem_tracker import MemTracker
    cfg = get_config("nano")
    m = GPT(cfg)
    opt = optim.build(m, **optimizer_kwargs(TrainConfig()))
    x, y = torch.randint(0, 256, (4, 64)), torch.randint(0, 256, (4, 64))
    _step(m, opt)                                          # AdamW's state exists before both trackers start
    opt.zero_grad(set_to_none=True)
    inputs = {x.untyped_storage()._cdata, y.untyped_storage()._cdata}
    theirs = MemTracker()
    theirs.track_external(m, opt)
    with MemoryTracker().watch(m, opt) as mem, theirs:
        _, loss = m(x, y)
        after_forward = dict(mem.current)
        their_act = {st._cdata: info[0].mem_consumed for st, info in theirs._WINFO.items()
                     if "ACT" in str(info[0].reftype)}
        ours = {k: (v[0], v[1]) for k, v in mem._live.items() if isinstance(k, int)}
        loss.backward()
        opt.step()
    snap = {str(k).split(".")[-1].lower(): v
            for k, v in theirs.get_tracker_snapshot("current")[torch.device("cpu")].items()}
    params = list(m.parameters())
    psi = sum(p.numel() for p in params)
    assert snap["param"] == mem.current["parameters"] == 4 * psi
    assert snap["grad"] == mem.current["gradients"] == 4 * psi
    assert snap["opt"] == mem.current["optimizer"] == 8 * psi + 4 * len(params)
    assert their_act and all(k in ours and ours[k][1] in ("activations", "other") and ours[k][0] == n
                             for k, n in their_act.items())
    unseen = {k for k, (n, cat) in ours.items() if cat == "activations" and k not in their_act}
    assert unseen <= inputs, "every activation MemTracker misses must be an input created before tracking"
    assert sum(their_act.values()) == after_forward["activations"] + after_forward["other"] \
        - sum(ours[k][0] for k in unseen) - sum(b.numel() for b in m.buffers())   # buffers: its own category
    assert after_forward["activations"] == activation_bytes(cfg, 4, 64)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_activation_formula_holds_in_other_dtypes(dtype):
    """LayerNorm's saved mean and rstd have the input's dtype on CPU, so the count scales with the element size."""
    cfg = get_config("nano")
    m = GPT(cfg).to(dtype)
    x, y = torch.randint(0, 256, (2, 32)), torch.randint(0, 256, (2, 32))
    e = torch.tensor([], dtype=dtype).element_size()
    with MemoryTracker().watch(m) as mem:
        _, loss = m(x, y)
        assert mem.current["activations"] == activation_bytes(cfg, 2, 32, elem_bytes=e)
        del loss


def test_a_graph_dropped_without_backward_frees_its_activations():
    m = GPT("nano")
    x, y = torch.randint(0, 256, (2, 32)), torch.randint(0, 256, (2, 32))
    with MemoryTracker().watch(m) as mem:
        logits, loss = m(x, y)
        assert mem.current["activations"] > 0
        del logits, loss                           # no backward: autograd lets go of everything it saved
        # what is left is the model's buffers and the token ids, which the test still holds
        assert mem.current["activations"] == 0
        assert mem.current["other"] == (sum(b.numel() * b.element_size() for b in m.buffers())
                                        + 8 * (x.numel() + y.numel()))


def test_batch_of_one_gives_two_separate_tensors():
    x, y = ShardedBatches(16, 1).get(0)
    assert x.untyped_storage().data_ptr() != y.untyped_storage().data_ptr() and torch.equal(x[0, 1:], y[0, :-1])
