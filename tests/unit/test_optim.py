"""course_lib.optim: the from-scratch AdamW against torch.optim.AdamW bit for bit (float32 and float64, with weight
decay), the master-weight optimizer against torch's AdamW on the fp32 masters, 8-bit Adam's first step against
torch's, and the one factory's choices and refusals."""
from __future__ import annotations

import pytest
import torch

from course_lib import optim
from course_lib.memopt import precision as P
from course_lib.memopt import quantize as Q

SHAPES = [(7, 5), (13,), (3, 4, 2), (1,)]
HYPER = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _params(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g, dtype=dtype)) for s in SHAPES]


def _grads(step, dtype):
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(s, generator=g, dtype=dtype) * 10.0 ** (i - 2) for i, s in enumerate(SHAPES)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_adamw_is_bit_exact_with_torch_adamw_single_tensor_path(dtype):
    ours, theirs = _params(dtype), _params(dtype)
    opt_a = optim.AdamW(ours, **HYPER)
    opt_b = torch.optim.AdamW(theirs, foreach=False, **HYPER)
    for step in range(6):
        for a, b, g in zip(ours, theirs, _grads(step, dtype)):
            a.grad, b.grad = g.clone(), g.clone()
        opt_a.step()
        opt_b.step()
        for a, b in zip(ours, theirs):
            assert torch.equal(a, b), f"step {step}"
            sa, sb = opt_a.state[a], opt_b.state[b]
            assert torch.equal(sa["exp_avg"], sb["exp_avg"]) and torch.equal(sa["exp_avg_sq"], sb["exp_avg_sq"])
            assert sa["step"].dtype == sb["step"].dtype and sa["step"].item() == sb["step"].item() == step + 1
    assert ours[0].dtype == dtype and not torch.equal(ours[0], _params(dtype)[0])    # it did move


def test_adamw_skips_parameters_without_gradients_like_torch():
    ours, theirs = _params(torch.float32), _params(torch.float32)
    opt_a, opt_b = optim.AdamW(ours, **HYPER), torch.optim.AdamW(theirs, foreach=False, **HYPER)
    for step in range(3):
        for i, (a, b, g) in enumerate(zip(ours, theirs, _grads(step, torch.float32))):
            a.grad = b.grad = None if (i + step) % 2 else g
        opt_a.step()
        opt_b.step()
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))
    assert set(map(len, opt_a.state.values())) == {3} and len(opt_a.state) == len(opt_b.state)


@pytest.mark.parametrize("kw, match", [(dict(lr=0.0), "lr"), (dict(betas=(0.9, 1.0)), "betas"),
                                       (dict(weight_decay=-1.0), "weight_decay")])
def test_adamw_rejects_bad_hyper_parameters(kw, match):
    with pytest.raises(ValueError, match=match):
        optim.AdamW(_params(torch.float32), **kw)


def test_master_weights_step_is_torch_adamw_on_the_fp32_masters_then_a_rounding():
    """bf16 compute copy, fp32 masters kept from before the cast: every step the masters equal torch's AdamW fed the
    bf16 gradients in fp32, and the compute copy is their rounding."""
    fp32 = _params(torch.float32)
    reference = [torch.nn.Parameter(p.detach().clone()) for p in fp32]
    low = [torch.nn.Parameter(p.detach().bfloat16()) for p in fp32]
    for p, m in zip(low, fp32):
        optim.set_master(p, m.detach().clone())
    opt = optim.MixedPrecisionOptimizer(low, optim.AdamW, **HYPER)
    ref = torch.optim.AdamW(reference, foreach=False, **HYPER)
    assert isinstance(opt, optim.MixedPrecisionOptimizer) and isinstance(opt.optimizer, optim.AdamW)
    for step in range(4):
        for p, r, g in zip(low, reference, _grads(step, torch.float32)):
            p.grad = g.bfloat16()
            r.grad = p.grad.float()
        opt.step()
        ref.step()
        assert all(torch.equal(m, r) for m, r in zip(opt.masters, reference))
        assert all(torch.equal(p, r.bfloat16()) for p, r in zip(low, reference))
    assert opt.skipped == 0 and all(opt.state[p]["master"] is m for p, m in zip(low, opt.masters))


def test_without_a_kept_master_the_master_starts_from_the_parameter_itself():
    """ZeRO's flat shards have no kept master: the master is the shard's own (bf16) value in fp32."""
    shard = torch.nn.Parameter(torch.randn(11).bfloat16())
    opt = optim.MixedPrecisionOptimizer([shard], optim.AdamW, lr=1e-3)
    assert torch.equal(opt.masters[0], shard.detach().float()) and opt.masters[0].dtype == torch.float32


def test_a_learning_rate_change_reaches_the_inner_optimizer():
    p = torch.nn.Parameter(torch.ones(4).bfloat16())
    opt = optim.MixedPrecisionOptimizer([p], optim.AdamW, lr=1e-3, weight_decay=0.0)
    opt.param_groups[0]["lr"] = 0.5
    p.grad = torch.ones(4).bfloat16()
    opt.step()
    assert opt.optimizer.param_groups[0]["lr"] == 0.5 and torch.equal(p, torch.full((4,), 0.5).bfloat16())


def test_adam8bit_first_step_equals_torch_adamw_and_its_state_is_within_the_quantization_bound():
    """From zero state (which 8 bits hold exactly), step 1 is AdamW's bit for bit; what it keeps of m and v is then
    torch's exp_avg and exp_avg_sq to within the block-wise error bound."""
    ours, theirs = _params(torch.float32, seed=3), _params(torch.float32, seed=3)
    kw = dict(HYPER, weight_decay=0.05)
    opt_a, opt_b = Q.Adam8bit(ours, block_size=8, **kw), torch.optim.AdamW(theirs, foreach=False, **kw)
    for a, b, g in zip(ours, theirs, _grads(0, torch.float32)):
        a.grad, b.grad = g.clone(), g.clone()
    opt_a.step()
    opt_b.step()
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))
    for a, b in zip(ours, theirs):
        got = opt_a.dequantized_state(a)
        for name, kind in (("exp_avg", "dynamic"), ("exp_avg_sq", "dynamic_unsigned")):
            want = opt_b.state[b][name]
            bound = Q.error_bound(want, Q.quantize_blockwise(want, 8, kind))
            assert ((got[name] - want).abs() <= bound).all(), name


def _model(dtype=torch.float32):
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2)).to(dtype)


def test_the_one_factory_builds_what_the_techniques_applied_to_the_model_ask_for():
    """`optim.build(model)`: the optimizer named or given; fp32 masters around it where the precision recipe keeps
    them (its scaler and vote included); the inner optimizer itself where it does not."""
    assert type(optim.build(_model(), lr=1e-3)) is optim.AdamW
    assert type(optim.build(_model(), optimizer=Q.Adam8bit, lr=1e-3)) is Q.Adam8bit
    pure = P.apply_precision(_model(), recipe="bf16-pure")
    assert type(optim.build(pure, optimizer=torch.optim.SGD, lr=1e-3)) is torch.optim.SGD
    half = P.apply_precision(_model(), recipe="fp16")
    mixed = optim.build(half, optimizer=Q.Adam8bit, lr=1e-3)
    assert isinstance(mixed, optim.MixedPrecisionOptimizer) and isinstance(mixed.optimizer, Q.Adam8bit)
    assert mixed.scaler is half.scaler and mixed.param_groups[0]["params"] == list(half.parameters())


def test_the_factory_refuses_an_unknown_optimizer():
    with pytest.raises(ValueError, match="unknown optimizer 'lion'"):
        optim.build(_model(), optimizer="lion", lr=1e-3)


def test_the_vote_of_one_process_is_its_own_flag():
    assert optim.overflow_vote(True) is True and optim.overflow_vote(False, None) is False


def test_fp32_parameters_are_their_own_masters_and_the_scaled_step_is_adamws_on_the_unscaled_gradient():
    """FSDP's fp32 shards (it casts them itself): no second copy; with loss scale S = 2^5 the step equals torch's
    AdamW fed g (the gradients arrive as S·g, S a power of two: unscaling is exact)."""
    ours, theirs = _params(torch.float32), _params(torch.float32)
    opt = optim.MixedPrecisionOptimizer(ours, optim.AdamW, scaler=P.DynamicLossScaler(init_scale=2.0 ** 5), **HYPER)
    ref = torch.optim.AdamW(theirs, foreach=False, **HYPER)
    assert all(m.data_ptr() == p.data_ptr() for m, p in zip(opt.masters, ours))
    for step in range(3):
        for a, b, g in zip(ours, theirs, _grads(step, torch.float32)):
            a.grad, b.grad = g * 2.0 ** 5, g.clone()
        opt.step()
        ref.step()
    assert opt.skipped == 0 and all(torch.equal(a, b) for a, b in zip(ours, theirs))
