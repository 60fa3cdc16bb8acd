import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from course_lib.core.model import (
    GPT,
    PRESETS,
    TP_PLAN,
    GPTConfig,
    count_parameters,
    get_config,
    matmul_param_count,
    param_count,
    stage_bounds,
    train_flops_per_token,
)

VARIANTS = [get_config("nano", tie_weights=True), get_config("nano", bias=False),
            get_config("micro", mlp_ratio=2, vocab_size=100, seq_len=50, n_head=8)]


@pytest.mark.parametrize("cfg", list(PRESETS.values()) + VARIANTS, ids=list(PRESETS) + ["tied", "nobias", "odd"])
def test_param_count_formula_equals_sum_of_numel(cfg):
    assert param_count(cfg) == count_parameters(GPT(cfg))


def test_presets_span_50k_to_20m_parameters():
    counts = sorted(param_count(c) for c in PRESETS.values())
    assert 30_000 <= counts[0] <= 60_000 and 15_000_000 <= counts[-1] <= 25_000_000


@pytest.mark.parametrize("name", ["nano", "micro"])
def test_train_flops_per_token_equals_flop_counter(name):
    cfg = get_config(name)
    model = GPT(cfg)
    x = torch.randint(0, cfg.vocab_size, (3, cfg.seq_len))
    with FlopCounterMode(display=False) as fc:
        model(x, x)[1].backward()
    assert fc.get_total_flops() == 3 * cfg.seq_len * train_flops_per_token(cfg)
    assert matmul_param_count(cfg) < param_count(cfg)


@pytest.mark.parametrize("bad, match", [
    (dict(d_model=30, n_head=4), "must divide d_model"),
    (dict(n_layer=0), "positive integer"),
    (dict(d_model=-8), "positive integer"),
    (dict(seq_len=2.5), "positive integer"),
    (dict(n_head=True), "positive integer"),
])
def test_impossible_config_raises_value_error_saying_what_to_change(bad, match):
    with pytest.raises(ValueError, match=match):
        GPTConfig(**bad)


def test_unknown_preset_lists_the_choices():
    with pytest.raises(ValueError, match="nano"):
        get_config("huge")


def test_init_is_deterministic_from_the_seed():
    a, b, c = GPT("nano", seed=1), GPT("nano", seed=1), GPT("nano", seed=2)
    for (n, p), q, _r in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(p, q), n
    assert any(not torch.equal(p, r) for p, r in zip(a.parameters(), c.parameters()))


def test_a_tied_weight_gets_the_sum_of_both_uses_gradients():
    """Tying makes the embedding and the LM head one parameter: its gradient is the untied embedding's gradient plus
    the untied head's, from one backward."""
    tied = GPT(get_config("nano", tie_weights=True), seed=3)
    untied = GPT("nano", seed=3)
    with torch.no_grad():
        for (name, _p), q in zip(untied.named_parameters(), untied.parameters()):
            if name != "lm_head.weight":
                q.copy_(dict(tied.named_parameters())[name])
        untied.lm_head.weight.copy_(tied.wte.weight)
    x = torch.randint(0, 256, (2, 16))
    tied(x, x)[1].backward()
    untied(x, x)[1].backward()
    assert count_parameters(tied) == count_parameters(untied) - 256 * 32
    torch.testing.assert_close(tied.wte.weight.grad, untied.wte.weight.grad + untied.lm_head.weight.grad)


def test_forward_shapes_and_too_long_sequence():
    m = GPT("nano")
    x = torch.randint(0, 256, (2, 10))
    logits, loss = m(x, x)
    assert logits.shape == (2, 10, 256) and loss.ndim == 0
    with pytest.raises(ValueError, match="longer than"):
        m(torch.zeros(1, 65, dtype=torch.long))


def test_pieces_compose_to_the_full_forward():
    m = GPT("nano")
    x = torch.randint(0, 256, (2, 16))
    h = m.embed(x)
    for a, b in m.stage_bounds(2):
        for blk in m.blocks[a:b]:
            h = blk(h)
    assert torch.allclose(m.head(h), m(x)[0])


def test_stage_bounds_are_contiguous_and_balanced():
    assert stage_bounds(5, 2) == [(0, 3), (3, 5)]
    assert stage_bounds(4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    with pytest.raises(ValueError, match="n_stages <= n_layer"):
        stage_bounds(2, 3)
    with pytest.raises(ValueError):
        stage_bounds(2, 0)


def test_the_tp_plan_splits_each_block_so_that_partial_results_sum_to_the_full_one():
    """TP_PLAN is a valid Megatron plan: cut every 'column' linear by output features and every 'row' linear by
    input features into two halves; running each half of the attention (one half of the heads) and of the MLP and
    adding the two partial outputs gives the unsplit block's output."""
    m = GPT("nano", seed=1)
    blk = m.blocks[0]
    lin = m.tp_linears()
    assert {k.split(".", 2)[2] for k in lin} == set(TP_PLAN) and len(lin) == m.config.n_layer * len(TP_PLAN)
    h = torch.randn(2, 8, m.config.d_model)

    def half(module, kind, i):
        w, b = module.weight.detach(), module.bias.detach()
        if kind == "column":        # half of the output features, with their biases
            cut = w.shape[0] // 2
            w, b = w[i * cut:(i + 1) * cut], b[i * cut:(i + 1) * cut]
        else:                       # row: half of the input features; the bias is added once
            cut = w.shape[1] // 2
            w, b = w[:, i * cut:(i + 1) * cut], b * (i == 0)
        part = torch.nn.Linear(w.shape[1], w.shape[0])
        with torch.no_grad():
            part.weight.copy_(w)
            part.bias.copy_(b)
        return part

    for name in ("attn", "mlp"):
        sub = getattr(blk, name)
        full = sub(h)
        parts = []
        for i in range(2):
            copy = type(sub).__new__(type(sub))
            copy.__dict__.update(sub.__dict__)
            copy._modules = dict(sub._modules)
            for key, (module, kind) in lin.items():
                if key.startswith(f"blocks.0.{name}."):
                    copy._modules[key.rsplit(".", 1)[1]] = half(module, kind, i)
            parts.append(copy(h))
        torch.testing.assert_close(parts[0] + parts[1], full, rtol=1e-5, atol=1e-6)
