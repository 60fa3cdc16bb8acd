import pytest

from course_lib import optim
from course_lib.core.data import ShardedBatches
from course_lib.core.model import GPT, get_config
from course_lib.train import (
    GradProbe,
    LedgerProbe,
    MemoryProbe,
    Probe,
    TrainConfig,
    evaluate,
    optimizer_kwargs,
    run,
    sample,
    train_reference,
    uniform_loss,
)


def test_reference_training_learns_and_is_deterministic():
    tc = TrainConfig(steps=25, batch_size=8, lr=1e-2)
    a = train_reference("nano", tc, progress=False)
    b = train_reference("nano", tc, progress=False)
    assert a.losses == b.losses
    assert abs(a.losses[0] - uniform_loss()) < 0.2            # starts near ln 256
    assert sum(a.losses[-5:]) / 5 < a.losses[0] - 1.5          # and learns
    assert evaluate(a.model, batches=2) < uniform_loss() - 1.0
    assert len(sample(a.model, "def ", n=10)) >= 10


def test_bad_train_config():
    with pytest.raises(ValueError, match="batch_size"):
        TrainConfig(batch_size=0)


def test_accumulating_micro_batches_hands_the_optimizer_the_whole_batchs_gradient():
    """K micro-batches of b, each loss scaled by 1/K, sum to the gradient of one batch of K·b (in float64, where
    only the summation order differs)."""
    cfg = get_config("nano")
    grads = {}
    for K in (1, 4):
        m = GPT(cfg).double()
        data = ShardedBatches(cfg.seq_len, 8 // K, accum_steps=K)
        r = run(m, optim.build(m, **optimizer_kwargs(TrainConfig())), data, steps=1, probes=[GradProbe()])
        grads[K] = r["grads"]
    assert max((grads[1][k] - grads[4][k]).abs().max().item() for k in grads[1]) < 1e-12


def test_probes_see_every_phase_and_the_states_after_the_step():
    cfg = get_config("nano")
    m = GPT(cfg)
    opt = optim.build(m, **optimizer_kwargs(TrainConfig()))
    seen = []

    class Spy(Probe):
        name = "spy"

        def enter(self, step, phase):
            seen.append((step, phase))

    r = run(m, opt, ShardedBatches(cfg.seq_len, 2), steps=2, probes=[MemoryProbe(timeline=False), Spy()])
    assert seen == [(0, "forward"), (0, "backward"), (0, "step"), (1, "forward"), (1, "backward"), (1, "step")]
    psi, n = sum(p.numel() for p in m.parameters()), len(list(m.parameters()))
    after = r["memory"]["after_step"]
    assert len(after) == 2 and after[1]["gradients"] == 4 * psi and after[1]["optimizer"] == 8 * psi + 4 * n
    assert [label for _, label in r["memory"]["report"].marks] == ["fwd 0", "bwd 0", "opt 0", "fwd 1", "bwd 1", "opt 1"]
    assert len(r.windows) == 2 and all(t1 > t0 for t0, t1 in r.windows) and r.tokens == 2 * 2 * cfg.seq_len


def test_grad_probe_copies_are_not_counted_by_a_memory_probe():
    cfg = get_config("nano")
    m = GPT(cfg)
    with_grads = run(m, optim.build(m, **optimizer_kwargs(TrainConfig())), ShardedBatches(cfg.seq_len, 2), steps=1,
                     probes=[MemoryProbe(timeline=False), GradProbe()])
    m = GPT(cfg)
    without = run(m, optim.build(m, **optimizer_kwargs(TrainConfig())), ShardedBatches(cfg.seq_len, 2), steps=1,
                  probes=[MemoryProbe(timeline=False)])
    assert with_grads["memory"]["after_step"] == without["memory"]["after_step"] and with_grads["grads"]


def test_run_refuses_bad_steps_and_two_probes_with_one_name():
    cfg = get_config("nano")
    m = GPT(cfg)
    opt = optim.build(m, **optimizer_kwargs(TrainConfig()))
    data = ShardedBatches(cfg.seq_len, 2)
    with pytest.raises(ValueError, match="steps"):
        run(m, opt, data, steps=-1)
    with pytest.raises(ValueError, match="share a name"):
        run(m, opt, data, steps=1, probes=[GradProbe(), GradProbe()])
    with pytest.raises(TypeError):
        LedgerProbe()                                          # a ledger probe needs a communicator


def test_progress_bar_shows_the_loss_without_a_redraw_per_step(monkeypatch):
    """run(progress=True) hands the bar each loss with refresh=False and lets tqdm pace its redraws: in a notebook
    kernel a redraw is a widget message, and one per step cost 30% of a nano step."""
    import tqdm.auto
    calls = []

    class Bar:
        def __init__(self, *args, **kwargs):
            calls.append(("open", kwargs["total"]))

        def set_postfix(self, refresh=True, **kwargs):
            calls.append(("postfix", refresh, kwargs["loss"]))

        def update(self, n=1):
            calls.append(("update", n))

        def close(self):
            calls.append(("close",))

    monkeypatch.setattr(tqdm.auto, "tqdm", Bar)
    m = GPT(get_config("nano"))
    r = run(m, optim.build(m, **optimizer_kwargs(TrainConfig())), ShardedBatches(64, 2), steps=3, progress=True)
    assert calls == [("open", 3)] \
        + [c for loss in r.losses for c in (("postfix", False, f"{loss:.3f}"), ("update", 1))] \
        + [("close",)]
