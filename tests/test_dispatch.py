"""The architecture facts (archs.py) and the dispatch table (dispatch.py), without a GPU."""

import importlib

import pytest

from ptxattn import archs, dispatch
from ptxattn.launchers import hopper_forward, kernel_head_dim


# ---------------------------------------------------------------------------------------------
# Architectures


@pytest.mark.parametrize("capability, arch", [
    ((8, 0), "sm_80"), ((8, 6), "sm_86"), ((8, 9), "sm_89"), ((9, 0), "sm_90a"),
    ((10, 0), "sm_100a"), ((10, 3), "sm_103a"), ((12, 0), "sm_120a"), ((12, 1), "sm_121a"),
])
def test_each_capability_has_its_compile_target(capability, arch):
    assert archs.arch_for_capability(*capability) == arch
    assert archs.get(arch).capability == capability


@pytest.mark.parametrize("capability", [(7, 5), (7, 0), (6, 1)])
def test_gpus_below_sm80_are_refused(capability):
    with pytest.raises(archs.UnsupportedGpuError, match=r"compute capability 8.0 \(sm_80, "
                                                        r"Ampere\) or newer"):
        archs.arch_for_capability(*capability)


@pytest.mark.parametrize("capability", [(8, 7), (11, 0), (13, 0)])
def test_unknown_gpus_are_refused_with_the_known_ones(capability):
    with pytest.raises(archs.UnsupportedGpuError, match=r"no kernels for compute capability "
                                                        r".*sm_90a \(9.0\)"):
        archs.arch_for_capability(*capability)


def test_unknown_arch_names_are_refused():
    with pytest.raises(ValueError, match=r"arch must be one of \['sm_80', .*got 'sm_75'"):
        archs.get("sm_75")


def test_shared_memory_per_block():
    kb = 1024
    assert archs.SMEM_LIMIT_BYTES == {
        "sm_80": 163 * kb, "sm_86": 99 * kb, "sm_89": 99 * kb, "sm_90a": 227 * kb,
        "sm_100a": 227 * kb, "sm_103a": 227 * kb, "sm_120a": 99 * kb, "sm_121a": 99 * kb}


def test_where_each_family_runs():
    assert archs.running("portable") == tuple(archs.ARCHS)
    assert archs.running("hopper") == ("sm_90a",)
    assert archs.running("blockscaled") == ("sm_120a", "sm_121a")
    assert archs.running("blockscaled", emulated=True) == ("sm_90a",)
    assert archs.running("portable", emulated=True) == ()


# ---------------------------------------------------------------------------------------------
# The table


def _chosen(arch, input_format, head_dim=128, **kwargs):
    route = dispatch.select(arch, input_format, head_dim, **kwargs)
    return route.launcher.__name__, route.backend


@pytest.mark.parametrize("input_format", ["bfloat16", "float16"])
def test_16_bit_inputs_run_hopper_on_sm90a_and_portable_elsewhere(input_format):
    for arch in archs.ARCHS:
        expected = "hopper" if arch == "sm_90a" else "portable"
        assert _chosen(arch, input_format) == (f"ptxattn.launchers.{expected}_forward", expected)
        assert _chosen(arch, input_format, backend="portable") == (
            "ptxattn.launchers.portable_forward", "portable")


def test_hopper_asked_for_on_another_gpu_names_the_arch_and_where_it_runs():
    with pytest.raises(ValueError, match=r"bfloat16 attention does not run on this sm_80 GPU; "
                                         r"it runs as backend 'hopper' \(ptxattn.launchers.hopper_forward.forward\) on "
                                         r"sm_90a with head_dim a multiple of 8 from 8 to 256 "
                                         r"\(compiled [0-9, ]+\), head_dim_v <= head_dim"):
        dispatch.select("sm_80", "bfloat16", 128, backend="hopper")


def test_fp8_runs_on_hopper_only():
    assert _chosen("sm_90a", "e4m3") == ("ptxattn.launchers.hopper_forward", "hopper")
    for arch in set(archs.ARCHS) - {"sm_90a"}:
        with pytest.raises(ValueError, match=rf"e4m3 attention does not run on this {arch} "
                                             rf"GPU; it runs as backend 'hopper' "
                                             rf"\(ptxattn.launchers.hopper_forward.forward\) "
                                             rf"on sm_90a"):
            dispatch.select(arch, "e4m3", 128)


@pytest.mark.parametrize("input_format", ["mxfp8", "nvfp4"])
def test_block_scaled_inputs_run_natively_on_sm120_and_emulated_on_sm90a(input_format):
    for arch in ("sm_120a", "sm_121a"):
        route = dispatch.select(arch, input_format, 64)
        assert (route.launcher.__name__, route.emulated) == ("ptxattn.launchers.blockscaled",
                                                             False)
    route = dispatch.select("sm_90a", input_format, 64)
    assert (route.launcher.__name__, route.backend, route.emulated) == (
        "ptxattn.launchers.blockscaled", "blockscaled-emulated", True)
    with pytest.raises(ValueError, match=rf"{input_format} attention does not run on this "
                                         rf"sm_100a GPU; .*sm_120a, sm_121a.*; .*emulated\) on "
                                         rf"sm_90a"):
        dispatch.select("sm_100a", input_format, 64)


SIXTEEN_BIT_RULE = r"a multiple of 8 from 8 to 256 \(compiled [0-9, ]+\), head_dim_v <= head_dim"
FP8_RULE = r"a multiple of 16 from 16 to 256 \(compiled [0-9, ]+\)"


@pytest.mark.parametrize("arch, input_format, head_dim, head_dim_v, supported", [
    ("sm_120a", "mxfp8", 256, 256, r"64, 128"),
    ("sm_120a", "mxfp8", 96, 96, r"64, 128"),
    ("sm_90a", "nvfp4", 256, 256, r"64, 128"),
    ("sm_90a", "bfloat16", 100, 100, SIXTEEN_BIT_RULE),
    ("sm_86", "float16", 264, 264, SIXTEEN_BIT_RULE),
    ("sm_80", "bfloat16", 4, 4, SIXTEEN_BIT_RULE),
    ("sm_90a", "bfloat16", 64, 72, SIXTEEN_BIT_RULE),
    ("sm_90a", "e4m3", 512, 512, FP8_RULE),
    ("sm_90a", "e4m3", 40, 40, FP8_RULE),
    ("sm_90a", "e4m3", 128, 64, FP8_RULE),
])
def test_unsupported_head_dims_name_the_arch_and_what_runs(arch, input_format, head_dim,
                                                           head_dim_v, supported):
    dims = (f"head_dim {head_dim}" if head_dim_v == head_dim
            else f"head_dim {head_dim} with head_dim_v {head_dim_v}")
    with pytest.raises(ValueError, match=rf"{input_format} attention at {dims} does not run on "
                                         rf"{arch}; it runs as backend .* with head_dim "
                                         rf"{supported}"):
        dispatch.select(arch, input_format, head_dim, head_dim_v=head_dim_v)


def test_kernel_head_dim_is_the_least_compiled_one_that_holds_the_call():
    for head_dims, compiled in ((range(8, 65, 8), 64), (range(72, 129, 8), 128),
                                (range(136, 257, 8), 256)):
        for head_dim in head_dims:
            assert kernel_head_dim((64, 128, 256), head_dim) == compiled, head_dim
    with pytest.raises(ValueError, match=r"head_dim must be at most 256, got 264"):
        kernel_head_dim((64, 128, 256), 264)


# (arch, features, backend) -> the launcher and call of the route taken
PADDED_ROUTES = [
    ("sm_90a", set(), None, "hopper_forward", "forward"),
    ("sm_90a", {"causal", "gqa"}, "portable", "portable_forward", "forward"),
    ("sm_90a", {"backward", "causal", "gqa"}, None, "hopper_backward", "backward"),
    ("sm_90a", {"backward", "varlen"}, "portable", "portable_backward", "backward"),
    ("sm_90a", {"varlen", "causal", "gqa"}, None, "hopper_forward", "serve"),
    ("sm_90a", {"kvcache", "paged", "decode"}, None, "portable_decode", "serve"),
    ("sm_80", {"causal"}, None, "portable_forward", "forward"),
    ("sm_80", {"backward", "gqa"}, None, "portable_backward", "backward"),
    ("sm_120a", {"kvcache", "decode"}, None, "portable_decode", "serve"),
]


@pytest.mark.parametrize("arch, features, backend, launcher, call", PADDED_ROUTES)
def test_head_dims_between_the_compiled_ones_and_narrow_values_take_their_routes(
        arch, features, backend, launcher, call):
    """Every multiple of 8 up to 256 runs where the compiled head dims do, and so do value
    heads narrower than the keys'."""
    for head_dim, head_dim_v in ((8, 8), (40, 40), (72, 72), (136, 136), (200, 200), (192, 128),
                                 (128, 64), (96, 64), (80, 40), (256, 8)):
        for input_format in dispatch.SIXTEEN_BIT:
            route = dispatch.select(arch, input_format, head_dim, head_dim_v=head_dim_v,
                                    features=features, backend=backend)
            assert (route.launcher.__name__, route.call) == (
                f"ptxattn.launchers.{launcher}", call), (head_dim, head_dim_v, input_format)


@pytest.mark.parametrize("head_dim", [16, 80, 96, 144, 192, 240])
def test_fp8_runs_every_multiple_of_16_on_hopper(head_dim):
    assert _chosen("sm_90a", "e4m3", head_dim) == ("ptxattn.launchers.hopper_forward", "hopper")


def test_unknown_backends_formats_and_archs_are_named():
    with pytest.raises(ValueError, match=r"backend must be one of \['hopper', 'portable'\] or "
                                         r"None for bfloat16 inputs, got 'cudnn'"):
        dispatch.select("sm_90a", "bfloat16", 128, backend="cudnn")
    with pytest.raises(ValueError, match=r"input format must be one of \['bfloat16', "
                                         r"'float16', 'e4m3', 'mxfp8', 'nvfp4'\], got 'e5m2'"):
        dispatch.select("sm_90a", "e5m2", 128)
    with pytest.raises(ValueError, match=r"arch must be one of .* got 'sm_75'"):
        dispatch.select("sm_75", "bfloat16", 128)


def test_serving_calls_route_by_their_query_rows():
    """On Hopper, prefill (varlen, a cache, a window, sinks) runs the Hopper kernel's serving
    build and decode steps the decode kernel; paged caches take the decode kernel."""
    def runs(route):
        return route.launcher.__name__.removeprefix("ptxattn.launchers."), route.call

    prefill = dispatch.select("sm_90a", "bfloat16", 128, features={"varlen", "causal", "gqa"})
    assert runs(prefill) == ("hopper_forward", "serve")
    assert runs(dispatch.select("sm_90a", "float16", 64, features={"kvcache", "window"})) == (
        "hopper_forward", "serve")
    assert runs(dispatch.select("sm_90a", "bfloat16", 256, features={"kvcache", "sinks"})) == (
        "hopper_forward", "serve")
    assert runs(dispatch.select("sm_90a", "bfloat16", 128, features={"varlen", "softcap"})) == (
        "hopper_forward", "serve")
    for extra in ("decode", "paged"):
        route = dispatch.select("sm_90a", "bfloat16", 128, features={"kvcache", extra})
        assert runs(route) == ("portable_decode", "serve"), extra
    assert runs(dispatch.select("sm_80", "bfloat16", 128, features={"varlen"})) == (
        "portable_decode", "serve")


def test_fixed_length_calls_with_serving_options_run_on_a_serving_build():
    """A window, a softcap or sinks take the Hopper serving build, few query rows the decode
    kernel, and plain calls the fixed-length kernels."""
    assert dispatch.select("sm_90a", "bfloat16", 128, features={"window"}).call == "serve"
    assert dispatch.select("sm_90a", "bfloat16", 128,
                           features={"softcap"}).launcher.__name__.endswith("hopper_forward")
    assert dispatch.select("sm_90a", "bfloat16", 128, features={"softcap", "decode"}
                           ).launcher.__name__.endswith("portable_decode")
    assert dispatch.select("sm_90a", "bfloat16", 128, features={"causal"}).call == "forward"


def test_backward_calls_run_hopper_on_sm_90a_and_portable_otherwise():
    for head_dim in (64, 128, 256):
        route = dispatch.select("sm_90a", "bfloat16", head_dim,
                                features={"backward", "causal", "gqa"})
        assert route.launcher.__name__ == "ptxattn.launchers.hopper_backward", head_dim
    assert dispatch.select("sm_90a", "bfloat16", 128, features={"backward"},
                           backend="portable").launcher.__name__ == (
        "ptxattn.launchers.portable_backward")
    assert dispatch.select("sm_80", "bfloat16", 128, features={"backward"}).call == "backward"
    for features in ({"backward", "window", "causal"}, {"backward", "softcap"},
                     {"backward", "sinks", "gqa"}, {"backward", "varlen"}):
        for arch, launcher in (("sm_90a", "hopper_backward"), ("sm_80", "portable_backward")):
            route = dispatch.select(arch, "bfloat16", 64, features=features)
            assert route.launcher.__name__ == f"ptxattn.launchers.{launcher}", features
    with pytest.raises(ValueError, match=r"with backward, kvcache at head_dim 128 does not run "
                                         r"on sm_90a"):
        dispatch.select("sm_90a", "bfloat16", 128, features={"backward", "kvcache"},
                        backend="hopper")


def test_forward_calls_never_take_a_backward_route():
    """The backward routes handle the serving options too; a forward call with them still goes
    to a forward or serving route, and a backward call never to a forward one."""
    for features in ({"softcap"}, {"window", "sinks"}, {"varlen", "softcap"}):
        assert dispatch.select("sm_90a", "bfloat16", 128, features=features).call != "backward"
    assert dispatch.select("sm_90a", "bfloat16", 128, features={"backward"}).call == "backward"


def test_a_route_lacking_a_feature_is_passed_over(monkeypatch):
    """A kernel without GQA (say) listed first is skipped for GQA calls, and the error names
    the feature when no route has it."""
    no_gqa = dispatch.Route("hopper", "hopper", dispatch.SIXTEEN_BIT, (64, 128, 256),
                            hopper_forward, features=frozenset({"causal"}))
    others = tuple(route for route in dispatch.TABLE if route.backend != "hopper")
    monkeypatch.setattr(dispatch, "TABLE", (no_gqa, *others))
    assert dispatch.select("sm_90a", "bfloat16", 128, features={"causal"}).backend == "hopper"
    assert dispatch.select("sm_90a", "bfloat16", 128, features={"gqa"}).backend == "portable"
    with pytest.raises(ValueError, match=r"bfloat16 attention with causal, gqa at head_dim 128 "
                                         r"does not run on sm_90a: backend 'hopper' .* handles "
                                         r"causal$"):
        dispatch.select("sm_90a", "bfloat16", 128, features={"causal", "gqa"},
                        backend="hopper")


def test_what_the_other_modules_read_from_the_table():
    assert dispatch.BACKENDS == ("hopper", "portable")
    assert dispatch.head_dims("nvfp4") == (64, 128)
    assert dispatch.archs_for("e4m3") == ("sm_90a",)
    assert set(dispatch.archs_for("mxfp8")) == {"sm_90a", "sm_120a", "sm_121a"}


# ---------------------------------------------------------------------------------------------
# The table against the kernels the launcher modules build


@pytest.mark.parametrize("route, arch", [
    pytest.param(route, arch, id=f"{route.backend}-{route.formats[0]}-{arch}")
    for route in dispatch.TABLE for arch in route.archs])
def test_every_route_has_kernels_built_for_its_archs_and_head_dims(route, arch):
    module = route.launcher
    fp8 = route.formats == ("e4m3",)
    assert route.head_dims == (module.FP8_HEAD_DIMS if fp8 else module.HEAD_DIMS)
    assert callable(getattr(module, route.call)), route.call
    if fp8:
        assert route.head_dims == importlib.import_module("ptxattn.fp8").HEAD_DIMS
    builds = [spec for spec in module.variants() if arch in spec.archs]
    if route.family == "blockscaled":  # one module, native and emulation builds
        builds = [spec for spec in builds if spec.name.endswith(
            "emulated" if route.emulated else "native")]
    assert builds, f"{module.__name__} builds nothing for {arch}"
