import pytest
import torch

from course_lib.memory import (CATEGORIES, MemoryTracker, SimulatedAccelerator, SimulatedOutOfMemoryError,
                               alloc_category, fmt_bytes, parse_bytes)
from course_lib.model import GPT, activation_bytes, block_activation_bytes, get_config
from course_lib.train import TrainConfig, make_optimizer, profile_training_memory


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
    assert mem.current["parameters"] == sum(p.numel() for p in m.parameters()) * torch.tensor([], dtype=dtype).element_size()


def test_gradients_and_adamw_state_are_exact():
    m = GPT("nano")
    opt = make_optimizer(m.parameters(), TrainConfig())
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
    opt = make_optimizer(m.parameters())
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
            opt = make_optimizer(m.parameters())
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


def test_categories_are_the_documented_six():
    assert CATEGORIES == ("parameters", "gradients", "optimizer", "activations", "comm", "other")
