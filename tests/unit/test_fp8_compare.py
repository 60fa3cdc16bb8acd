"""Our FP8 linear against torchao's, at many seeds: the one comparison of notebook 09 that once held for some seeds
only (SEED = 3 and 5 failed on an AMD EPYC). It now compares what is exact (memopt.fp8_compare: each linear on the
same input and output gradient, within 2·γ_(K+4)·(|A|·|B|)), and this test holds that bound at eight seeds, so a
seed-dependent margin cannot come back unseen without running the whole notebook eight times."""
import pytest

from course_lib.core.data import ShardedBatches
from course_lib.core.model import GPT, get_config
from course_lib.memopt import fp8_compare as C8

pytest.importorskip("torchao")


@pytest.mark.parametrize("seed", range(8))
def test_ours_and_torchaos_fp8_linears_agree_within_fp32_rounding_at_any_seed(seed):
    cfg = get_config("nano")
    x, y = (t[:2] for t in ShardedBatches(cfg.seq_len, 8, seed=seed).get(0))      # notebook 09's AO_SEQS = 2
    layers = C8.compare_with_torchao(GPT(cfg, seed=seed), x, y)
    assert layers, "no FP8 linears compared"
    for name, row in layers.items():
        for what in ("y", "grad x", "grad W"):
            assert row[what]["of_bound"] <= 1, (f"seed {seed}, {name} {what}: ours and torchao differ by "
                                                f"{row[what]['of_bound']:.2f}× the fp32 rounding bound")

