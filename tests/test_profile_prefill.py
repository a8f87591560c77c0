"""experiments/tools/profile_prefill.py: its parts add up to the total it prints, kernel names go to
the part they belong to, and bad arguments are refused before anything runs."""
import re

import pytest

from experiments.tools import profile_prefill


def test_kernel_names_go_to_their_parts():
    names = {"_prefill_indexer_kernel": "indexer scores", "void at::native::sbtopk::gatherTopK<float>": "top-k and ordering",
             "_order_picks_kernel": "top-k and ordering", "_radix_topk_kernel": "top-k and ordering",
             "_sparse_mla_decode_gluon_kernel": "sparse attention",
             "nvjet_tst_128x256_64x4_2x1_v_bz_coopB_TNT": "matrix products",
             "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n": "matrix products",
             "void at::native::vectorized_elementwise_kernel<4, ...>": "elementwise, copies, reductions"}
    for name, part in names.items():
        assert profile_prefill.part_of(name) == part, name


def test_quick_profile_parts_sum_to_the_total(capsys):
    assert profile_prefill.main(["--quick", "--context", "40", "--top", "3"]) == 0
    out = capsys.readouterr().out.splitlines()
    total = float(re.search(r", ([0-9.]+) s of CPU ops' self time", out[0]).group(1))
    parts = [float(line.split()[0]) for line in out[1:1 + len(profile_prefill.PARTS)]]
    assert [line.split("%  ")[1] for line in out[1:1 + len(parts)]] == [p for p, _ in profile_prefill.PARTS]
    assert total > 0 and abs(sum(parts) - total) <= 0.001 * len(parts) + 1e-9, (parts, total)
    assert out[1 + len(parts)].startswith("the 3 kernels with the most time") and len(out) == len(parts) + 5


@pytest.mark.parametrize("argv, message", [(["--quick", "--context", "0"], "--context 0: expected a positive integer"),
                                           (["--quick", "--chunk-size", "-4"], "--chunk-size -4: expected a positive")])
def test_bad_arguments_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        profile_prefill.main(argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err
