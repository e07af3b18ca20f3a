"""The profiler's runners, read from the dispatch table (no GPU): one per 16-bit backend that
runs on the arch, with that backend's head dims; the pure parts of --backward-features: the
(query, key) pairs a mask lets through, the mixed-length draw, a row's line, the refusal of two
runs at once; and of --serving: its parts, the MLA rows, their FLOPs, a decode row's line."""

import pytest

from ptxattn.tools import profile


def test_each_16_bit_backend_that_runs_on_the_arch_has_a_runner():
    assert sorted(profile.ptxattn_runners("sm_90a")) == ["ptxattn-hopper", "ptxattn-portable"]
    assert sorted(profile.ptxattn_runners("sm_80")) == ["ptxattn-portable"]
    head_dims, max_seqlen, _ = profile.ptxattn_runners("sm_90a")["ptxattn-hopper"]
    assert head_dims == (64, 128, 192, 256) and max_seqlen is None


def test_visible_pairs_counts_each_query_row_s_keys():
    assert profile.visible_pairs(2048, 2048, False) == 2048 * 2048
    assert profile.visible_pairs(2048, 2048, True) == 2048 * 2049 // 2  # the diagonal included
    # bottom-right aligned: 4 queries over 6 keys see 3, 4, 5 and 6 keys
    assert profile.visible_pairs(4, 6, True) == 3 + 4 + 5 + 6
    # a causal window (4096, 0): query i sees min(i, 4096) + 1 keys
    seqlen, left = 32768, 4096
    assert profile.visible_pairs(seqlen, seqlen, True, (left, 0)) == (
        left * (left + 1) // 2 + (seqlen - left) * (left + 1)) == 125_859_840
    # (2, 1) without the mask: 4 keys a row, cut at both ends
    assert profile.visible_pairs(8, 8, False, (2, 1)) == 8 * 4 - (2 + 1) - 1


def test_varlen_pairs_sum_the_sequences_pairs():
    assert profile.varlen_pairs([2048] * 8, True) == 8 * profile.visible_pairs(2048, 2048, True)
    assert profile.varlen_pairs([3, 5], False) == 9 + 25
    assert profile.varlen_pairs([3, 5], True, (1, 0)) == (1 + 2 + 2) + (1 + 2 + 2 + 2 + 2)


def test_mixed_lengths_lie_in_range_sum_to_about_the_total_and_repeat_with_the_seed():
    lengths = profile.mixed_lengths(16384, 128, 8192)
    assert all(128 <= n <= 8192 for n in lengths)
    assert 16384 - 128 < sum(lengths) <= 16384
    assert lengths == profile.mixed_lengths(16384, 128, 8192, seed=0)
    assert lengths != profile.mixed_lengths(16384, 128, 8192, seed=1)
    # a mix: short and long sequences both
    assert min(lengths) < 512 and max(lengths) > 2048
    assert profile.mixed_lengths(100, 128, 8192) == []


def test_a_feature_line_gives_each_call_s_tflops_and_its_time_over_the_plain_call_s():
    flops = 2e12  # forward: the backward does 2.5 times as much, 5e12 in 10 ms is 500 TFLOP/s
    ms = {"plain": 10.0, "softcap 50": 12.5}
    line = profile.feature_line("4 x 4096 causal", ms, {"plain": flops, "softcap 50": flops},
                                "plain")
    assert line == ("4 x 4096 causal: plain 500.0 (10.000 ms), softcap 50 400.0 (12.500 ms); "
                    "time / plain's: softcap 50 1.250")
    # the plain call failed: no ratios
    assert profile.feature_line("x", {"sinks": 10.0}, {"sinks": flops}, "plain") == (
        "x: sinks 500.0 (10.000 ms)")
    assert profile.feature_line("x", {}, {"sinks": flops}, "plain") == "x: no call ran"


def test_two_runs_at_once_are_refused_before_any_timing(capsys):
    with pytest.raises(SystemExit):
        profile.main(["--backward", "--backward-features"])
    assert "--backward and --backward-features are runs of their own" in capsys.readouterr().err
    for option in (["--energy"], ["--plot", "x.png"], ["--grid", "targets"]):
        with pytest.raises(SystemExit):
            profile.main(["--backward-features", *option])


def test_serving_runs_every_part_or_those_mla_and_fp8_cache_pick():
    assert profile.serving_sections(False, False) == ("decode", "prefill", "mla", "fp8-cache")
    assert profile.serving_sections(True, False) == ("mla",)
    assert profile.serving_sections(False, True) == ("fp8-cache",)
    assert profile.serving_sections(True, True) == ("mla", "fp8-cache")


def test_mla_rows_group_by_cache_and_quick_keeps_batch_64():
    rows = profile.mla_shapes(quick=False)
    one_token = [(r["batch"], r["keys"], r["heads"]) for r in rows if r["seqlen_q"] == 1]
    assert sorted(one_token) == sorted((b, l, h) for b in (64, 128) for l in (4096, 16384)
                                       for h in (128, 16))
    assert sorted((r["batch"], r["seqlen_q"]) for r in rows if r["seqlen_q"] > 1) == [
        (64, 2), (64, 4), (128, 2), (128, 4)]
    assert all(r["heads"] == 128 and r["keys"] == 4096 for r in rows if r["seqlen_q"] > 1)
    # the rows of one cache are adjacent: the serving run builds each cache once
    caches = [(r["batch"], r["keys"]) for r in rows]
    assert len(set(caches)) == 4 and caches == sorted(caches, key=caches.index)
    assert profile.mla_shapes(quick=True) == [r for r in rows if r["batch"] == 64]


def test_mla_flops_count_the_576_wide_scores_and_the_512_wide_values():
    assert profile.MLA_WIDTH == 576 and profile.MLA_LATENT == 512
    assert profile.mla_flops(64, 1, 128, 4096) == 2 * 64 * 128 * 4096 * (576 + 512)
    assert profile.mla_flops(128, 4, 128, 4096) == 8 * profile.mla_flops(64, 1, 128, 4096)


def test_a_decode_row_gives_gb_s_its_fraction_of_the_copy_tflops_and_e4m3_over_16_bit():
    # 2 GB in 1 ms is 2000 GB/s, 0.50 of a 4000 GB/s copy; 1 GB (e4m3) in 0.5 ms the same
    ms = {"bf16": 1.0, "e4m3": 0.5}
    assert profile.cache_read_line("batch  64, caches", ms, 2e9, 4000.0) == (
        "batch  64, caches: bf16 2000 (0.50), e4m3 4000 (1.00)")
    line = profile.cache_read_line("x", ms, {"bf16": 2e9, "e4m3": 1e9}, 4000.0, flops=5e11,
                                   ratios={"contiguous": ("e4m3", "bf16"),
                                           "fa3": ("fa3-e4m3", "fa3")})
    assert line == ("x: bf16 2000 (0.50) 500 TFLOP/s, e4m3 2000 (0.50) 1000 TFLOP/s; "
                    "tokens/s e4m3 over 16-bit: contiguous 2.00")
    assert profile.cache_read_line("x", {}, 1e9, 4000.0) == "x: no call ran"


def test_mla_and_fp8_cache_need_serving(capsys):
    for option in ("--mla", "--fp8-cache"):
        with pytest.raises(SystemExit):
            profile.main([option])
        assert "add --serving" in capsys.readouterr().err
