"""course_lib.memopt.quantize on one process: block-wise codes are the nearest grid values and within the stated
bound, bytes are exact, the dynamic map equals bitsandbytes', 8-bit Adam's state is 2Ψ + 8·Σ⌈n/B⌉ bytes and it
trains like AdamW and like bitsandbytes' Adam8bit, weight-only quantization's bytes and errors, and bad input."""
from __future__ import annotations

import logging
import math

import pytest
import torch

from course_lib import optim
from course_lib.core.data import ShardedBatches
from course_lib.core.model import GPT, get_config
from course_lib.memopt import quantize as Q
from course_lib.train import MemoryProbe, TrainConfig, optimizer_kwargs, run

logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")   # torch.jit, inside bitsandbytes
CFG = get_config("nano")


def _spread(n=10_000, seed=0, low=-30, high=5):
    """Values over many binades, as Adam's moments and gradients are."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g) * torch.exp2(torch.randint(low, high, (n,), generator=g).float())


# ============================================================================================ codes and bounds
@pytest.mark.parametrize("kind", Q.KINDS)
@pytest.mark.parametrize("block_size", [1, 64, 1000, 2048, 20_000])
def test_every_element_is_within_the_methods_bound(kind, block_size):
    x = _spread()
    x = x.abs() if kind == "dynamic_unsigned" else x
    q = Q.quantize_blockwise(x, block_size, kind)
    err = (Q.dequantize_blockwise(q).double() - x.double()).abs()
    assert (err <= Q.error_bound(x, q)).all()


@pytest.mark.parametrize("kind, qmax", [("int8", 127), ("int4", 7)])
def test_linear_codes_err_by_at_most_absmax_over_2_qmax(kind, qmax):
    """formulas §7.5: |error| ≤ Δ/2 = N_b/(2·qmax), i.e. N_b/254 for int8 and N_b/14 for int4."""
    x = _spread(4096)
    q = Q.quantize_blockwise(x, 512, kind)
    err = (Q.dequantize_blockwise(q) - x).abs().view(-1, 512)
    absmax = x.abs().view(-1, 512).amax(dim=1)
    assert (err.amax(dim=1) <= absmax / (2 * qmax) * (1 + 1e-6)).all()


@pytest.mark.parametrize("kind", ["dynamic", "dynamic_unsigned"])
def test_dynamic_codes_are_the_nearest_map_values(kind):
    """Brute force: the code's value is as close to x/N_b as any of the 256 (unsigned: a positive value is never
    rounded to 0, the one deliberate exception)."""
    x = _spread(3072)
    x = x.abs() if kind == "dynamic_unsigned" else x
    q = Q.quantize_blockwise(x, 256, kind)
    code = Q.dynamic_map(kind == "dynamic")
    v = (x.view(-1, 256) / q.scales[:, None]).reshape(-1)
    dist = (v[:, None] - code[None, :]).abs()                       # (n, 256)
    chosen = dist.gather(1, q.codes.long()[:, None]).squeeze(1)
    smallest = code[code > 0].min()
    floor = (kind == "dynamic_unsigned") & (v > 0) & (v < smallest / 2)
    assert torch.equal(chosen[~floor], dist.min(dim=1).values[~floor])
    assert (code[q.codes.long()][floor] == smallest).all() and floor.any() == (kind == "dynamic_unsigned")


def test_the_dynamic_maps_equal_bitsandbytes_and_our_codes_are_never_farther_than_its():
    import bitsandbytes.functional as BF
    for signed in (True, False):
        assert torch.equal(Q.dynamic_map(signed), BF.create_dynamic_map(signed=signed))
    x = _spread(8192, low=-10)
    ours = Q.quantize_blockwise(x, 256, "dynamic")
    theirs, state = BF.quantize_blockwise(x, code=BF.create_dynamic_map(True), blocksize=256)
    assert torch.equal(ours.scales, state.absmax)
    code = Q.dynamic_map(True)
    v = (x.view(-1, 256) / ours.scales[:, None]).reshape(-1)
    d_ours, d_theirs = (code[ours.codes.long()] - v).abs(), (code[theirs.long()] - v).abs()
    assert (d_ours <= d_theirs).all()                    # bitsandbytes' CPU search is approximate; ours is nearest
    assert (ours.codes == theirs).float().mean() > 0.8


def test_stored_bytes_are_one_per_code_and_four_per_block_whatever_the_block_size_divides():
    for n, B in [(10_000, 2048), (4096, 2048), (5, 2048), (1, 1)]:
        x = torch.randn(n)
        for kind in Q.KINDS:
            q = Q.quantize_blockwise(x.abs() if kind == "dynamic_unsigned" else x, B, kind)
            assert q.nbytes == Q.payload_bytes(n, kind) + 4 * math.ceil(n / B), (n, B, kind)
            assert q.scales.numel() == math.ceil(n / B)


def test_a_short_last_block_is_a_block_of_its_own():
    """block_size not dividing n: the tail is quantized with its own absmax, as if it had been padded with zeros."""
    x = torch.randn(2048 + 100)
    q = Q.quantize_blockwise(x, 2048, "int8")
    padded = Q.quantize_blockwise(torch.cat([x, torch.zeros(2048 - 100)]), 2048, "int8")
    assert torch.equal(q.scales, padded.scales) and torch.equal(q.codes, padded.codes[:x.numel()])
    assert torch.equal(Q.dequantize_blockwise(q), Q.dequantize_blockwise(padded)[:x.numel()])


def test_int4_packs_two_codes_per_byte_and_round_trips_odd_lengths():
    for n in (1, 7, 8, 4097):
        x = torch.randn(n)
        q = Q.quantize_blockwise(x, 64, "int4")
        assert q.codes.dtype == torch.uint8 and q.codes.numel() == (n + 1) // 2
        codes = torch.round(x.view(-1) / q.scales.repeat_interleave(64)[:n]).clamp(-7, 7)
        assert torch.equal(Q._unpack_int4(q.codes, n).float(), codes)


def test_an_all_zero_block_stores_zeros_without_dividing_by_zero():
    for kind in Q.KINDS:
        q = Q.quantize_blockwise(torch.zeros(100), 64, kind)
        assert torch.equal(Q.dequantize_blockwise(q), torch.zeros(100)), kind


@pytest.mark.parametrize("bad, match", [
    (torch.tensor([1.0, math.nan]), "NaN/inf"), (torch.tensor([math.inf, 1.0]), "NaN/inf"),
    (torch.tensor([1, 2]), "floating-point")])
def test_nan_inf_and_integer_inputs_raise_one_clear_error(bad, match):
    with pytest.raises(ValueError, match=match):
        Q.quantize_blockwise(bad, 64, "int8")


@pytest.mark.parametrize("kw, match", [(dict(block_size=0), "block_size"), (dict(block_size=2.5), "block_size"),
                                       (dict(kind="int2"), "unsupported quantization kind")])
def test_bad_block_sizes_and_kinds_raise(kw, match):
    with pytest.raises(ValueError, match=match):
        Q.quantize_blockwise(torch.randn(10), **{"block_size": 64, "kind": "int8", **kw})


def test_inside_the_ring_a_non_finite_block_decodes_to_nan_and_the_others_survive():
    x = torch.randn(200)
    x[5] = math.inf
    q = Q.quantize_blockwise(x, 64, "int8", allow_nonfinite=True)
    d = Q.dequantize_blockwise(q)
    assert d[:64].isnan().all() and torch.isfinite(d[64:]).all()


# ============================================================================================ 8-bit Adam
def _train(make, steps=30, probe=None):
    model = GPT(CFG)
    opt = make(model.parameters())
    r = run(model, opt, ShardedBatches(CFG.seq_len, 8), steps=steps, probes=[probe] if probe else [])
    return r, model, opt


def test_adam8bit_state_is_exactly_two_bytes_per_parameter_plus_eight_per_block():
    tc = TrainConfig(batch_size=8)
    for B in (2048, 256):
        probe = MemoryProbe(timeline=False)
        _, model, _ = _train(lambda ps, B=B: Q.Adam8bit(ps, block_size=B, **optimizer_kwargs(tc)), steps=2,
                             probe=probe)
        numels = [p.numel() for p in model.parameters()]
        assert probe.after[-1]["optimizer"] == Q.adam8bit_state_bytes(numels, B) == \
            2 * sum(numels) + 8 * sum(math.ceil(n / B) for n in numels)


def test_adam8bit_trains_like_adamw_and_like_bitsandbytes_adam8bit():
    """Same model, batches and hyper-parameters for 30 steps; bitsandbytes' CPU kernel uses blocks of 256, so ours
    does too. The losses agree to 0.02 (the seed-to-seed spread of this run is about 0.1)."""
    import bitsandbytes as bnb
    tc = TrainConfig(batch_size=8)
    adamw = _train(lambda ps: optim.AdamW(ps, **optimizer_kwargs(tc)))[0].losses
    ours = _train(lambda ps: Q.Adam8bit(ps, block_size=256, **optimizer_kwargs(tc)))[0].losses
    theirs = _train(lambda ps: bnb.optim.Adam8bit(ps, min_8bit_size=0, **optimizer_kwargs(tc)))[0].losses
    assert max(abs(a - b) for a, b in zip(ours, theirs)) < 0.02
    assert max(abs(a - b) for a, b in zip(ours, adamw)) < 0.02


def test_a_positive_second_moment_is_never_stored_as_zero():
    """Otherwise √v + eps collapses to eps and the update lr·m/eps explodes (tiny gradients next to large ones)."""
    p = torch.nn.Parameter(torch.zeros(1000))
    opt = Q.Adam8bit([p], lr=1e-2, block_size=256)
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        p.grad = torch.randn(1000, generator=g) * torch.exp2(torch.randint(-20, 0, (1000,), generator=g).float())
        opt.step()
    assert (opt.dequantized_state(p)["exp_avg_sq"] > 0).all() and p.abs().max() < 0.1


def test_adam8bit_rejects_a_bad_block_size():
    with pytest.raises(ValueError, match="block_size"):
        Q.Adam8bit([torch.nn.Parameter(torch.zeros(3))], block_size=0)


# ============================================================================================ weight-only PTQ
@pytest.mark.parametrize("bits, group", [(8, None), (4, 32), (4, 24), (8, 7)])
def test_weight_only_bytes_and_error_bound(bits, group):
    """Bytes equal the closed form (a group size that does not divide in_features pads each row's last group);
    every weight within Δ/2 of its group."""
    model = GPT(CFG)
    qmodel = Q.quantize_weights(model, bits=bits, group_size=group)
    assert Q.model_bytes(qmodel) == Q.ptq_bytes(model, bits=bits, group_size=group)
    weights = dict(model.named_parameters())
    n_quantized = 0
    for name, mod in qmodel.named_modules():
        if isinstance(mod, Q.QuantizedLinear):
            n_quantized += 1
            assert ((mod.dequantized_weight() - weights[f"{name}.weight"]).abs() <= mod.error_bound()).all()
    assert n_quantized == 6 * CFG.n_layer + 1
    x = ShardedBatches(CFG.seq_len, 2).get(0)[0]
    assert (qmodel(x)[0] - model(x)[0]).abs().max() < (0.05 if bits == 8 else 0.5)


def test_int8_per_channel_has_one_fp16_scale_per_output_row():
    lin = torch.nn.Linear(40, 24)
    q = Q.QuantizedLinear(lin, bits=8)
    assert q.codes.dtype == torch.int8 and q.codes.numel() == 40 * 24 and q.scales.dtype == torch.float16
    assert q.scales.numel() == 24
    assert torch.allclose(q.scales.float(), (lin.weight.abs().amax(dim=1) / 127).half().float())


@pytest.mark.parametrize("kw, match", [(dict(bits=3), "8 or 4 bits"), (dict(group_size=0), "group_size")])
def test_bad_ptq_settings_raise(kw, match):
    with pytest.raises(ValueError, match=match):
        Q.QuantizedLinear(torch.nn.Linear(8, 8), **{"bits": 8, **kw})
