from course_lib.train import TrainConfig, evaluate, sample, train_reference, uniform_loss


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
    import pytest
    with pytest.raises(ValueError, match="batch_size"):
        TrainConfig(batch_size=0)
