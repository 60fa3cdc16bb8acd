"""course_lib.memopt.precision: formats from their bit layouts against torch and the standards, the dynamic loss
scaler against torch.amp.GradScaler, mixed precision's bytes and numerics, FP8 simulation against torchao."""
from __future__ import annotations

import copy
import logging
import math
import random

import pytest
import torch

from course_lib import optim
from course_lib.core.data import ShardedBatches
from course_lib.core.model import GPT, get_config
from course_lib.memopt import precision as P
from course_lib.train import MemoryProbe, TrainConfig, optimizer_kwargs, run

CFG = get_config("nano")
TC = TrainConfig(steps=3, batch_size=4)


# ============================================================================================ formats
@pytest.mark.parametrize("name", [n for n, f in P.FORMATS.items() if f.dtype is not None])
def test_every_constant_derived_from_the_layout_equals_torch_finfo(name):
    f, fi = P.FORMATS[name], torch.finfo(P.FORMATS[name].dtype)
    assert (f.max, f.min_normal, f.eps, f.bits) == (fi.max, fi.smallest_normal, fi.eps, fi.bits)
    assert f.min_subnormal == 2.0 ** (math.log2(fi.smallest_normal) - f.mantissa_bits)


def test_the_layouts_give_the_standard_values():
    """IEEE 754 and the FP8 paper's Table 1 (docs/formulas.md §7.2), including tf32, which torch has no dtype for."""
    want = {"fp16": (65504.0, 2.0 ** -14, 2.0 ** -24, 2.0 ** -10), "fp8_e4m3": (448.0, 2.0 ** -6, 2.0 ** -9, 0.125),
            "fp8_e5m2": (57344.0, 2.0 ** -14, 2.0 ** -16, 0.25), "tf32": ((2 - 2.0 ** -10) * 2.0 ** 127, 2.0 ** -126,
                                                                       2.0 ** -136, 2.0 ** -10)}
    for name, row in want.items():
        f = P.FORMATS[name]
        assert (f.max, f.min_normal, f.min_subnormal, f.eps) == row


def _awkward_float32s(n=100_000, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g, dtype=torch.float64) * torch.exp2(
        torch.randint(-160, 130, (n,), generator=g).double())
    edges = torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan, 65504, 65519.99, 65520, 448, 464, 465, 57344,
                          61439, 61440, 2.0 ** -24, 2.0 ** -25, 1.5 * 2.0 ** -25, 2.0 ** -149, 3.0e38])
    return torch.cat([x, edges]).float()


@pytest.mark.parametrize("name", ["fp32", "fp16", "bf16", "fp8_e4m3", "fp8_e5m2"])
def test_round_to_nearest_even_from_the_layout_equals_torchs_cast(name):
    x = _awkward_float32s()
    mine, theirs = P.round_to(x.double(), name), x.to(P.FORMATS[name].dtype).double()
    assert torch.equal(mine.nan_to_num(), theirs.nan_to_num())
    assert torch.equal(mine.isnan(), theirs.isnan())


def test_round_to_tf32_equals_rounding_the_fp32_bit_pattern_to_10_mantissa_bits():
    x = _awkward_float32s()
    x = x[torch.isfinite(x) & (x.abs() < 3.4e38)]
    bits = x.view(torch.int32).long()
    rne = (bits + 0xFFF + ((bits >> 13) & 1)) & ~0x1FFF            # round half to even at bit 13
    assert torch.equal(P.round_to(x.double(), "tf32"), rne.to(torch.int32).view(torch.float32).double())


def test_nearest_rounding_errs_by_at_most_half_the_spacing():
    x = _awkward_float32s().double()
    for name, f in P.FORMATS.items():
        r = P.round_to(x, name)
        inside = torch.isfinite(x) & (x.abs() <= f.max)
        assert ((r - x).abs()[inside] <= P.spacing(x[inside], name) / 2).all(), name


def test_e4m3_saturates_and_e5m2_overflows_to_inf():
    big = torch.tensor([1e6, math.inf])
    assert P.cast(big, "fp8_e4m3").tolist() == [448.0, 448.0]
    assert P.cast(big, "fp8_e5m2").tolist() == [math.inf, math.inf]
    assert P.saturating_cast(torch.tensor([1e6, -1e6, math.inf]), "fp8_e5m2").float()[:2].tolist() == [57344, -57344]
    assert P.saturating_cast(torch.tensor([math.inf]), "fp8_e5m2").float().isnan().all()   # inf is not saturated


@pytest.mark.parametrize("bad", ["fp12", "float64", torch.int8, "int8"])
def test_unsupported_format_names_raise_one_clear_error(bad):
    with pytest.raises(ValueError, match="use one of|supported"):
        P.get_format(bad)


def test_aliases_and_dtypes_name_the_same_formats():
    assert P.get_format("half") is P.get_format(torch.float16) is P.FORMATS["fp16"]
    assert P.get_format("e4m3") is P.get_format(torch.float8_e4m3fn)


# ============================================================================================ the scaler
@pytest.mark.parametrize("kw", [dict(growth_interval=1), dict(growth_interval=3), dict(growth_interval=7,
                                init_scale=2.0 ** 4), dict(growth_interval=2, growth_factor=3.0, backoff_factor=0.25)])
def test_scale_trajectory_equals_grad_scalers_on_the_same_overflow_sequence(kw):
    rng = random.Random(sum(map(hash, kw)))
    flags = [rng.random() < 0.25 for _ in range(300)] + [True] * 5 + [False] * 40
    assert P.scaler_trajectory(P.DynamicLossScaler(**kw), flags) == P.grad_scaler_trajectory(flags, **kw)


def test_growth_stops_at_the_largest_finite_scale_like_grad_scaler():
    flags = [False] * 200
    kw = dict(init_scale=2.0 ** 120, growth_interval=1)
    ours = P.scaler_trajectory(P.DynamicLossScaler(**kw), flags)
    assert ours == P.grad_scaler_trajectory(flags, **kw) and math.isfinite(ours[-1]) and ours[-1] == 2.0 ** 127


@pytest.mark.parametrize("kw, match", [(dict(init_scale=0), "init_scale"), (dict(init_scale=math.inf), "init_scale"),
                                       (dict(growth_factor=1.0), "growth_factor"),
                                       (dict(backoff_factor=1.0), "backoff_factor"),
                                       (dict(growth_interval=0), "growth_interval")])
def test_bad_scaler_settings_raise(kw, match):
    with pytest.raises(ValueError, match=match):
        P.DynamicLossScaler(**kw)


def test_attach_backpropagates_the_scaled_loss_but_reports_the_true_one():
    w = torch.nn.Parameter(torch.tensor([2.0]))
    scaler = P.DynamicLossScaler(init_scale=8.0)
    loss = scaler.attach((w * 3).sum())
    loss.backward()
    assert loss.item() == 6.0 and w.grad.item() == 24.0
    assert scaler.unscale_([w.grad]) is False and w.grad.item() == 3.0
    w.grad = torch.tensor([math.inf])
    assert scaler.unscale_([w.grad]) is True


# ============================================================================================ mixed precision
def _train(recipe, steps=3, optimizer="adamw", scaler=None, probes=()):
    mp = P.apply_precision(GPT(CFG), recipe=recipe, scaler=scaler)
    opt = optim.build(mp, **optimizer_kwargs(TC))
    r = run(mp, opt, ShardedBatches(CFG.seq_len, 4), steps=steps, step_fn=mp.step_fn(), probes=probes)
    return r, mp, opt


@pytest.mark.parametrize("recipe", list(P.RECIPES))
def test_model_state_bytes_after_a_step_are_exactly_the_closed_form(recipe):
    probe = MemoryProbe(timeline=False)
    _, mp, _ = _train(recipe, steps=2, probes=[probe])
    want = P.model_state_bytes(recipe, [p.numel() for p in mp.parameters()])
    assert {k: probe.after[-1][k] for k in want} == want


def test_mixed_precision_with_adam_is_16_bytes_per_parameter_as_in_the_zero_paper():
    assert P.bytes_per_parameter("fp16") == {"weights": 2, "gradients": 2, "master": 4, "optimizer state": 8,
                                             "total": 16}
    assert P.bytes_per_parameter("bf16-pure")["total"] == 8
    assert P.bytes_per_parameter("bf16", "adam8bit", 2048)["total"] == 10 + 8 / 2048


def test_the_compute_copys_unscaled_gradient_is_fp32s_to_the_formats_precision():
    """fp16 (10 mantissa bits, with its loss scale) and bf16 (7 bits): the gradient the optimizer is handed differs
    from fp32's by about the unit round-off compounded through the layers: ≲ 2^−11·10 and 2^−8·10 here."""
    x, y = ShardedBatches(CFG.seq_len, 8).get(0)
    ref = GPT(CFG)
    ref(x, y)[1].backward()
    g32 = torch.cat([p.grad.flatten() for p in ref.parameters()])
    errors = {}
    for recipe in ("fp16", "bf16"):
        mp = P.apply_precision(GPT(CFG), recipe=recipe)
        with P.fp32_accumulation():
            mp(x, y)[1].backward()
        g = torch.cat([p.grad.float().flatten() for p in mp.parameters()]) / (mp.scaler.scale if mp.scaler else 1)
        errors[recipe] = ((g - g32).norm() / g32.norm()).item()
    assert errors["fp16"] < 10 * 2.0 ** -11 and errors["bf16"] < 10 * 2.0 ** -8 and errors["fp16"] < errors["bf16"]


def test_an_overflowing_step_is_skipped_and_the_scale_halves():
    mp = P.apply_precision(GPT(CFG), recipe="fp16", scaler=P.DynamicLossScaler(init_scale=2.0 ** 10))
    opt = optim.build(mp, **optimizer_kwargs(TC))
    before = [m.clone() for m in opt.masters]
    for p in mp.parameters():
        p.grad = torch.ones_like(p)
    next(mp.parameters()).grad[0] = math.inf
    opt.step()
    assert opt.skipped == 1 and mp.scaler.scale == 2.0 ** 9
    assert all(torch.equal(a, b) for a, b in zip(before, opt.masters))
    for p in mp.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    assert opt.skipped == 1 and not all(torch.equal(a, b) for a, b in zip(before, opt.masters))
    assert all(torch.equal(p, m.to(p.dtype)) for p, m in zip(mp.parameters(), opt.masters))   # copy = round(master)


def test_without_loss_scaling_fp16_activation_gradients_of_a_trained_model_underflow_and_with_it_none_do():
    model = GPT(CFG)
    run(model, optim.build(model, **optimizer_kwargs(TrainConfig(batch_size=8))), ShardedBatches(CFG.seq_len, 8),
        steps=80)
    x, y = ShardedBatches(CFG.seq_len, 32, seed=99).get(0)
    g32 = P.backward_gradients(model, x, y)
    half = copy.deepcopy(model).half()           # the bare cast: apply_precision would add its loss scale
    plain, scaled = P.backward_gradients(half, x, y), P.backward_gradients(half, x, y, scale=2.0 ** 16)
    ref, S = g32["activations"], 2.0 ** 16
    assert P.underflow_fraction(ref, plain["activations"]) > 0.01
    # With S no element is lost to fp16's range: any zero left is rounding inside fp16 arithmetic (a softmax
    # probability that rounds to 1 makes p − 1 exactly 0), i.e. its scaled fp32 value is one fp16 can hold (at least
    # half the smallest subnormal, below which a cast rounds to 0). Such zeros are rare (a handful in 655,360) and
    # depend on the platform's kernels and thread count; some of them lie in the subnormal range.
    lost = (scaled["activations"] == 0) & (ref != 0)
    assert ((ref[lost].abs() * S) >= P.FORMATS["fp16"].min_subnormal / 2).all()
    assert P.underflow_fraction(ref, scaled["activations"]) < P.underflow_fraction(ref, plain["activations"]) / 100
    assert not torch.isinf(scaled["activations"]).any()


def test_fp32_accumulation_is_the_fp32_product_rounded_once_and_agrees_with_the_cpus_fp16_matmul():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(64, 96, generator=g).half(), torch.randn(96, 48, generator=g).half()
    native = a @ b                                             # the CPU's own (emulated) fp16 matmul
    with P.fp32_accumulation():
        got = a @ b
    assert got.dtype == torch.float16 and torch.equal(got, (a.float() @ b.float()).half())
    # both accumulate in fp32 (in their own order): within one fp16 step plus the fp32 sums' rounding
    slack = P.spacing(got.double(), "fp16") + 2.0 ** -20 * (a.double().abs() @ b.double().abs())
    assert ((native.double() - got.double()).abs() <= slack).all()


def test_apply_precision_needs_an_fp32_model_and_a_known_recipe():
    with pytest.raises(ValueError, match="fp32 model"):
        P.apply_precision(GPT(CFG).half(), recipe="fp16")
    with pytest.raises(ValueError, match="unknown precision recipe"):
        P.apply_precision(GPT(CFG), recipe="fp12")


# ============================================================================================ FP8
def test_delayed_scaling_uses_the_history_before_this_cast_and_starts_at_one():
    s = P.Fp8Scaling("fp8_e4m3", history_len=3)
    amaxes = [2.0, 8.0, 1.0, 0.5, 0.25, 4.0]
    for a in amaxes:
        s.quantize(torch.tensor([a, -a / 2]))
    assert s.scales[0] == 1.0
    for i in range(1, len(amaxes)):
        assert s.scales[i] == P._f32(448.0 / max(amaxes[max(0, i - 3):i]))
    assert s.saturated == [0, 2, 0, 0, 0, 2]            # only when amax outgrew the history (both elements)


def test_current_scaling_never_saturates_and_maps_amax_to_the_format_max():
    s = P.Fp8Scaling("fp8_e5m2", delayed=False)
    x8, scale = s.quantize(torch.tensor([3e-6, -1e-7, 1e-9]))
    assert x8.dtype == torch.float8_e5m2 and x8.float().abs().max().item() == 57344.0 and sum(s.saturated) == 0


def test_a_non_finite_tensor_casts_to_nan_and_does_not_enter_the_history():
    s = P.Fp8Scaling("fp8_e4m3")
    s.quantize(torch.tensor([1.0, 2.0]))
    x8, _ = s.quantize(torch.tensor([1.0, math.inf]))
    assert x8.float()[1].isnan() and s.amax_history == [2.0]


def test_fp8_linears_save_one_byte_tensors_for_backward():
    model = P.apply_fp8(GPT(CFG))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.dtype) or t, lambda t: t):
        model(*ShardedBatches(CFG.seq_len, 2).get(0))[1].backward()
    assert saved.count(torch.float8_e4m3fn) == 2 * 6 * CFG.n_layer          # x and W of every block linear
    assert all(isinstance(m, P.Fp8Linear) for n, m in model.named_modules() if n.startswith("blocks.")
               and isinstance(m, torch.nn.Linear))
    assert type(model.lm_head) is torch.nn.Linear


def test_fp8_with_current_scaling_matches_torchaos_float8_training():
    logging.getLogger("torchao").setLevel(logging.ERROR)
    from torchao.float8 import convert_to_float8_training
    x, y = ShardedBatches(CFG.seq_len, 8).get(1)
    out = []
    for model in (P.apply_fp8(GPT(CFG), delayed=False),
                  convert_to_float8_training(GPT(CFG), module_filter_fn=lambda m, fqn: "blocks." in fqn), GPT(CFG)):
        logits, loss = model(x, y)
        loss.backward()
        out.append((logits.detach(), torch.cat([p.grad.flatten() for p in model.parameters()])))
    (lm, gm), (la, ga), (l32, g32) = out

    def rel(a, b):
        return ((a - b).norm() / b.norm()).item()
    # not fp32-exact: a rounding difference that crosses an fp8 rounding boundary moves a value by a whole fp8 step
    # (notebook 09 explains); both must be far closer to torchao's than fp8 is to fp32
    assert rel(lm, la) < rel(lm, l32) / 20 and rel(gm, ga) < rel(gm, g32) / 20


def test_apply_fp8_with_a_filter_that_matches_nothing_says_so():
    with pytest.raises(ValueError, match="no nn.Linear"):
        P.apply_fp8(GPT(CFG), filter=lambda name: False)


# ============================================================================================ the contract
def test_apply_precision_changes_the_model_in_place_and_keeps_its_kind_names_and_fp32_masters():
    from course_lib import optim
    model = GPT(CFG)
    names = [n for n, _ in model.named_parameters()]
    originals = [p.detach().clone() for p in model.parameters()]
    out = P.apply_precision(model, recipe="bf16")
    assert out is model and isinstance(model, GPT) and isinstance(model, P.MixedPrecisionModel)
    assert [n for n, _ in model.named_parameters()] == names
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert all(torch.equal(optim.master_of(p), o) for p, o in zip(model.parameters(), originals))   # not rounded
    x, y = ShardedBatches(CFG.seq_len, 2).get(0)
    logits, loss = model(x, y)
    assert logits.dtype == torch.float32 and loss.dtype == torch.float32
    assert model.embed(x).dtype == torch.bfloat16                  # its pieces still work, in the compute dtype
    with pytest.raises(ValueError, match="already cast"):
        P.apply_precision(model, recipe="bf16")


def test_a_pipeline_stage_stays_a_stage_and_only_the_last_one_gets_fp32_logits():
    from course_lib.parallel.pipeline.stage import PipelineStage
    bounds = GPT(CFG).stage_bounds(2)
    first = P.apply_precision(PipelineStage(GPT(CFG), [0], bounds, 2), recipe="bf16")
    last = P.apply_precision(PipelineStage(GPT(CFG), [1], bounds, 2), recipe="bf16")
    assert isinstance(first, PipelineStage) and isinstance(last, PipelineStage)
    x, y = ShardedBatches(CFG.seq_len, 2).get(0)
    h = first(x)
    assert h.dtype == torch.bfloat16 and last(h.detach()).dtype == torch.float32
    assert last(h.detach(), y).dtype == torch.float32


def test_the_loss_scale_enters_at_the_logits_and_the_reported_loss_is_the_true_one():
    """fp16 with S = 2^10 against the same model unscaled: the same loss is reported, and the gradient entering
    backward at the (fp32) logits is exactly S times the unscaled one (S is a power of two)."""
    x, y = ShardedBatches(CFG.seq_len, 2).get(0)
    S = 2.0 ** 10
    scaled = P.apply_precision(GPT(CFG), recipe="fp16", scaler=P.DynamicLossScaler(init_scale=S))
    plain = P.apply_precision(GPT(CFG), recipe="fp16-unscaled")
    out = []
    for m in (scaled, plain):
        with P.fp32_accumulation():
            logits, loss = m(x, y)
            logits.retain_grad()                   # retained after the tensor's other hooks: what backward starts from
            loss.backward()
        out.append((loss.item(), logits.grad))
    (l_s, g_s), (l_p, g_p) = out
    assert l_s == l_p and g_s.dtype == torch.float32 and torch.equal(g_s, g_p * S) and g_p.abs().max() > 0


def test_a_deep_copy_scales_with_its_own_scaler_and_a_model_without_blocks_is_no_wrapper():
    from course_lib.core.model import blocks_of
    x, y = ShardedBatches(CFG.seq_len, 2).get(0)
    model = P.apply_precision(GPT(CFG), recipe="fp16", scaler=P.DynamicLossScaler(init_scale=4.0))
    twin = copy.deepcopy(model)
    twin.scaler.scale = 8.0
    grads = []
    for m in (model, twin):
        with P.fp32_accumulation():
            logits, loss = m(x, y)
            logits.retain_grad()
            loss.backward()
        grads.append(logits.grad)
    assert model.scaler.scale == 4.0 and torch.equal(grads[1], grads[0] * 2)
    assert not hasattr(model, "module")                           # in place: nothing to unwrap
    linear = P.apply_precision(torch.nn.Linear(3, 3), recipe="bf16")
    with pytest.raises(TypeError, match="no transformer blocks"):
        blocks_of(linear)
