"""The profiler's runners, read from the dispatch table (no GPU): one per 16-bit backend that
runs on the arch, with that backend's head dims."""

from ptxattn.tools import profile


def test_each_16_bit_backend_that_runs_on_the_arch_has_a_runner():
    assert sorted(profile.ptxattn_runners("sm_90a")) == ["ptxattn-hopper", "ptxattn-portable"]
    assert sorted(profile.ptxattn_runners("sm_80")) == ["ptxattn-portable"]
    head_dims, max_seqlen, _ = profile.ptxattn_runners("sm_90a")["ptxattn-hopper"]
    assert head_dims == (64, 128, 256) and max_seqlen is None
