"""The runtime on its own: NVRTC compile, ptxas reports, TMA descriptors, launches (the disk
cache: test_cache.py)."""

import ctypes

import numpy as np
import pytest

from probe_kernels import probe_spec
from ptxattn import runtime

PROBE = probe_spec("tma_copy_probe", "tma_copy_probe.cu", "tma_copy_probe",
                   smem_bytes=64 * 1024, archs=("sm_90a", "sm_120a"))


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PTXATTN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(runtime, "_compiled", {})
    return tmp_path


def test_compile_reports_ptxas_numbers(cache):
    compiled = runtime.compile(PROBE, "sm_90a")
    assert compiled.cubin[:4] == b"\x7fELF"
    if compiled.report is None and runtime.nvrtc_version() < (13, 5):
        pytest.skip("NVRTC 13.0 leaves the ptxas report out when a process compiles the same "
                    "program twice; 13.5 (CI's) always reports")
    assert compiled.report.registers > 0
    assert compiled.spill_bytes == 0
    assert compiled.smem_bytes >= PROBE.smem_bytes + 8  # dynamic tile + the static mbarrier


def test_compile_error_carries_log_and_kernel_name(tmp_path, monkeypatch, cache):
    (tmp_path / "broken.cu").write_text('extern "C" __global__ void broken() { not_declared(); }\n')
    monkeypatch.setattr(runtime, "SOURCE_DIR", tmp_path)
    spec = runtime.KernelSpec("broken_variant", "broken.cu", "broken")
    with pytest.raises(runtime.CompileError) as info:
        runtime.compile(spec, "sm_80")
    assert info.value.kernel == "broken_variant"
    assert "not_declared" in info.value.log
    assert "broken_variant" in str(info.value)


def test_an_empty_nvrtc_log_leaves_shared_one_byte_objects_intact(cache, monkeypatch):
    # NVRTC writes its log, NUL-terminated, into the buffer it is given. NVRTC 13.0 sometimes
    # gives an empty log (a lone NUL), which once went into `b" " * 1`: CPython's shared b" ".
    # Every later b" " then read as NUL, and `import torch` failed on a mangled op schema.
    real = runtime._nvrtc()

    class EmptyLog:
        def __getattr__(self, name):
            return getattr(real, name)

        def nvrtcGetProgramLogSize(self, prog):
            return real.nvrtcResult.NVRTC_SUCCESS, 1

        def nvrtcGetProgramLog(self, prog, buffer):
            if isinstance(buffer, bytes):  # where NVRTC would write: the object's own bytes
                address = ctypes.cast(ctypes.c_char_p(buffer), ctypes.c_void_p).value
            else:
                address = ctypes.addressof((ctypes.c_char * len(buffer)).from_buffer(buffer))
            ctypes.memset(address, 0, 1)
            return (real.nvrtcResult.NVRTC_SUCCESS,)

    monkeypatch.setattr(runtime, "_nvrtc", EmptyLog)
    assert runtime.compile(PROBE, "sm_90a").cubin[:4] == b"\x7fELF"
    space = b" "  # not `b" "[0]`, which the compiler would fold to 32
    assert space[0] == 0x20


def test_spec_refuses_arch_it_is_not_built_for(cache):
    with pytest.raises(runtime.PtxattnError, match="not built for sm_80"):
        runtime.compile(PROBE, "sm_80")


def test_ptxas_report_parse_picks_the_entry():
    log = ("ptxas info    : Function properties for helper\n"
           "ptxas         .     8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads\n"
           "ptxas info    : Function properties for k\n"
           "ptxas         .     0 bytes stack frame, 12 bytes spill stores, 16 bytes spill loads\n"
           "ptxas info    : Used 168 registers, used 1 barriers, 2048 bytes smem\n")
    report = runtime.PtxasReport.parse(log, "k")
    assert report == runtime.PtxasReport(168, 12, 16, 2048, 0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,box", [("bfloat16", (1, 64, 1, 64)), ("uint8", (1, 32, 1, 128))])
def test_tma_moves_a_tile_bit_for_bit(dtype, box, rng):
    import cupy

    if runtime.device_arch() not in PROBE.archs:
        pytest.skip("TMA needs sm_90 or newer")
    shape = (2, 100, 3, box[3] * 2)
    nbytes = int(np.prod(shape)) * cupy.dtype(dtype).itemsize
    src = cupy.asarray(rng.integers(0, 256, size=nbytes, dtype=np.uint8))
    src = src.view(cupy.dtype(dtype)).reshape(shape)
    dst = cupy.zeros_like(src)
    kernel = runtime.load(PROBE)
    # A box hanging over the seqlen edge: TMA must zero-fill the load and clip the store.
    coords = (box[3], 2, 80, 1)
    tile_bytes = int(np.prod(box)) * src.itemsize
    runtime.launch(kernel, (1,), (32,),
                   [runtime.tensor_map(src, box, swizzle=128), runtime.tensor_map(dst, box, swizzle=128),
                    *(np.int32(c) for c in coords), np.int32(tile_bytes)])
    cupy.cuda.get_current_stream().synchronize()
    expected = cupy.zeros_like(src)
    window = (1, slice(80, 80 + box[1]), 2, slice(box[3], 2 * box[3]))
    expected[window] = src[window]
    assert bool((dst.view(cupy.uint8) == expected.view(cupy.uint8)).all())


@pytest.mark.gpu
def test_launch_rejects_python_scalars():
    kernel = runtime.load(PROBE) if runtime.device_arch() in PROBE.archs else None
    if kernel is None:
        pytest.skip("TMA needs sm_90 or newer")
    with pytest.raises(TypeError, match="np.int32"):
        runtime.launch(kernel, (1,), (32,), [1])


def test_launch_cache_builds_once_per_key_and_drops_the_least_recent():
    built = []

    def build(name):
        def make():
            built.append(name)
            return object()
        return make

    cache = runtime.LaunchCache(size=2)
    first = cache.get(("a",), build("a"))
    assert cache.get(("a",), build("a")) is first and built == ["a"]
    cache.get(("b",), build("b"))
    cache.get(("a",), build("a"))  # a is now the most recent, b the least
    cache.get(("c",), build("c"))  # evicts b
    assert built == ["a", "b", "c"]
    cache.get(("a",), build("a"))
    cache.get(("b",), build("b"))
    assert built == ["a", "b", "c", "b"]


def test_array_key_follows_address_and_layout():
    from meta_array import MetaArray

    x = MetaArray((2, 8, 4, 64), "bfloat16")
    assert runtime.array_key(x) == runtime.array_key(MetaArray((2, 8, 4, 64), "bfloat16"))
    assert runtime.array_key(x) != runtime.array_key(MetaArray((2, 8, 4, 64), "float16"))
    assert runtime.array_key(x) != runtime.array_key(
        MetaArray((2, 8, 4, 64), "bfloat16", strides=(65536, 128, 16384, 2)))
    assert runtime.array_key(x) != runtime.array_key(MetaArray((2, 8, 4, 64), ptr=2 << 20))
