"""The decision picture's three added rows (course_lib.memopt.offload.decision) against docs/formulas.md §14.6."""
import pytest

from course_lib.core.costmodel import get_link
from course_lib.memopt.memory_fit import Machine, fit_options, gpt_shape
from course_lib.memopt.offload import decision as D
from course_lib.parallel.tensor.sequence import paper_activation_bytes


def test_the_rows_extend_fit_options_unchanged():
    m = Machine(device_bytes=16e9)
    out = D.decision_options(1e9, m)
    assert {k: out[k] for k in fit_options(1e9, m)} == fit_options(1e9, m)
    assert {"Mobius", "vDNN", "FlashNeuron"} <= set(out)


def test_mobius_holds_three_layer_stages_and_pays_4psi_of_pcie():
    psi, m = 3e9, Machine(device_bytes=16e9, device_flops=1e18)      # a device so fast the link shows
    shape = gpt_shape(psi)
    L, h, a = shape["n_layer"], shape["d_model"], shape["n_head"]
    row = D.decision_options(psi, m)["Mobius"]
    layer = paper_activation_bytes(m.seq_len, m.micro_batch_size, h, a)
    assert row["device"] == pytest.approx(6 * psi / L + layer + 2 * m.seq_len * m.micro_batch_size * h, rel=1e-12)
    adam = psi / (m.adam_per_core * m.host_cores)
    assert row["seconds"] == pytest.approx(get_link(m.pcie).time(4 * psi) + adam, rel=1e-12)


def test_flashneuron_moves_only_what_does_not_fit_and_a_faster_disk_never_hurts():
    base = dict(device_bytes=16e9, micro_batch_size=8, sequences_per_step=64)
    rows = [D.decision_options(5e8, Machine(**base, disk_read=bw, disk_write=bw)) for bw in (1e9, 1e10, 1e11, 1e13)]
    times = [r["FlashNeuron"]["seconds"] for r in rows]
    assert times == sorted(times, reverse=True)
    assert rows[-1]["FlashNeuron"]["seconds"] == pytest.approx(rows[-1]["none"]["seconds"], rel=1e-12)
    assert (rows[0]["FlashNeuron"]["device"] == pytest.approx(16e9)
            and rows[0]["vDNN"]["host"] == rows[0]["FlashNeuron"]["disk"])


def test_best_option_leaves_out_what_it_is_told_to():
    m = Machine(device_bytes=16e9)
    assert not (D.best_option(5e9, m, exclude=("ZeRO-3",)) or "").startswith("ZeRO-3")
