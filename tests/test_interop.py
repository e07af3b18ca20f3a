"""Arrays of other frameworks through every entry point (ptxattn.interop).

CPU: which framework an array belongs to is read without importing any; host arrays are refused
with a TypeError naming the argument; importing and calling ptxattn imports neither torch nor
JAX. GPU: torch tensors in, torch tensors out, zero-copy, on torch's current stream with no
synchronization added; JAX arrays in, JAX arrays out.
"""

import os
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

import ptxattn
from ptxattn import fp8, interop
from ptxattn.quant import blockscaled as quant


def _typed(module: str, bases=()):
    """An instance of a class that says it comes from ``module``."""
    return type("Array", bases, {"__module__": module})()


def test_framework_is_read_from_the_type_without_importing_it():
    assert interop.framework(_typed("torch")) == "torch"
    assert interop.framework(_typed("torch.nn.parameter")) == "torch"
    assert interop.framework(_typed("jaxlib._jax")) == "jax"
    assert interop.framework(_typed("jax._src.array")) == "jax"
    assert interop.framework(_typed("jaxtyping")) == "cupy"
    assert interop.framework(_typed("torchvision_like_but_not")) == "cupy"
    assert interop.framework(np.zeros(1)) == "cupy"
    torch_like = type(_typed("torch"))
    assert interop.framework(_typed("my_model", bases=(torch_like,))) == "torch"


def test_neither_torch_nor_jax_is_imported():
    """Importing ptxattn's modules and calling its entry points (refused here: no GPU needed)
    loads no framework, even where both are installed."""
    script = """
import sys
import numpy as np
import ptxattn, ptxattn.api, ptxattn.fp8, ptxattn.blockscaled, ptxattn.interop
x = np.zeros((1, 4, 2, 64), np.float16)
for call in (lambda: ptxattn.attention(x, x, x), lambda: ptxattn.fp8.quantize(x),
             lambda: ptxattn.blockscaled.quantize_mxfp8(x)):
    try:
        call()
    except TypeError:
        pass
print(sorted(m for m in ("torch", "jax", "jaxlib") if m in sys.modules))
"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            env=env, check=True)
    assert result.stdout.strip() == "[]", result.stdout + result.stderr


def _host(shape, dtype="float16"):
    return np.zeros(shape, dtype)


@pytest.mark.parametrize("entry,argument", [
    ("attention", "q"),
    ("attention_out", "out"),
    ("attention_backward", "dout"),
    ("fp8_attention", "q"),
    ("fp8_attention_descale", "q_descale"),
    ("fp8_quantize", "x"),
    ("fp8_dequantize", "x8"),
    ("mxfp8_quantize", "x"),
    ("mxfp8_quantize_v", "v"),
    ("nvfp4_quantize", "x"),
    ("blockscaled_attention", "q"),
])
def test_host_arrays_are_a_type_error_naming_the_argument(entry, argument):
    from meta_array import MetaArray

    x = _host((1, 4, 2, 64))
    e4m3 = _host((1, 4, 2, 64), ml_dtypes.float8_e4m3fn)
    calls = {
        "attention": lambda: ptxattn.attention(x, x, x),
        # stand-ins for the device arrays: only out is a host array
        "attention_out": lambda: ptxattn.attention(*[MetaArray(x.shape)] * 3, out=x),
        "attention_backward": lambda: ptxattn.attention_backward(
            x, x, x, x, x, _host((1, 2, 4), "float32")),
        "fp8_attention": lambda: fp8.attention(e4m3, e4m3, e4m3, q_descale=1.0, k_descale=1.0,
                                               v_descale=1.0),
        "fp8_attention_descale": lambda: fp8.attention(
            *[MetaArray(x.shape, fp8.E4M3)] * 3, q_descale=_host((), "float32"), k_descale=1.0,
            v_descale=1.0),
        "fp8_quantize": lambda: fp8.quantize(x),
        "fp8_dequantize": lambda: fp8.dequantize(e4m3, 1.0),
        "mxfp8_quantize": lambda: quant.quantize_mxfp8(x),
        "mxfp8_quantize_v": lambda: quant.quantize_mxfp8_v(x),
        "nvfp4_quantize": lambda: quant.quantize_nvfp4(x),
        "blockscaled_attention": lambda: ptxattn.blockscaled_attention(
            *[_host((1, 4, 2, 64), np.uint8)] * 6),
    }
    with pytest.raises(TypeError, match=rf"^{argument} must be a CUDA array \(.*\), got "
                                        r"numpy.ndarray in host memory$"):
        calls[entry]()


def test_cpu_torch_tensors_are_a_type_error():
    torch = pytest.importorskip("torch", reason="torch is not installed")
    q = torch.zeros(1, 4, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match=r"^q must be a CUDA array .*, got torch.Tensor in host "
                                        r"memory$"):
        ptxattn.attention(q, q, q)


def test_keyword_only_arguments_stay_keyword_only():
    x = _host((1, 4, 2, 64))
    with pytest.raises(TypeError, match=r"attention\(\) takes 3 positional arguments but 4"):
        ptxattn.attention(x, x, x, True)


# ---------------------------------------------------------------------------------------------
# GPU: torch


def _torch_qkv(generator, batch=2, seqlen=300, heads_q=4, heads_kv=2, head_dim=128,
               dtype="bfloat16"):
    import torch

    def normal(*shape):
        return torch.randn(*shape, generator=generator, device="cuda").to(getattr(torch, dtype))

    return (normal(batch, seqlen, heads_q, head_dim), normal(batch, seqlen, heads_kv, head_dim),
            normal(batch, seqlen, heads_kv, head_dim))


def _torch_generator(rng):
    import torch
    return torch.Generator(device="cuda").manual_seed(int(rng.integers(2 ** 31)))


def _cupy(x):
    import cupy
    return cupy.from_dlpack(x.detach())


@pytest.mark.gpu
def test_torch_in_torch_out_zero_copy(rng):
    torch = pytest.importorskip("torch", reason="torch is not installed")
    import cupy

    q, k, v = _torch_qkv(_torch_generator(rng))
    out = torch.full_like(q, float("nan"))
    lse = torch.empty(2, 4, 300, device="cuda", dtype=torch.float32)
    got_out, got_lse = ptxattn.attention(q, k, v, causal=True, return_lse=True, out=out, lse=lse)
    assert got_out is out and got_lse is lse  # the caller's own tensors, written in place
    assert not bool(out.isnan().any())
    fresh, fresh_lse = ptxattn.attention(q, k, v, causal=True, return_lse=True)
    assert isinstance(fresh, torch.Tensor) and isinstance(fresh_lse, torch.Tensor)
    assert fresh.device == q.device and fresh.dtype == q.dtype and fresh_lse.dtype == torch.float32
    assert torch.equal(fresh, out) and torch.equal(fresh_lse, lse)
    # the CuPy path on views of the same memory gives the same bits
    expected = ptxattn.attention(_cupy(q), _cupy(k), _cupy(v), causal=True)
    assert bool((cupy.from_dlpack(out) == expected).all())

    dout = torch.randn_like(q)
    dq, dk, dv = ptxattn.attention_backward(dout, q, k, v, out, lse, causal=True)
    assert all(isinstance(g, torch.Tensor) for g in (dq, dk, dv))
    assert dk.shape == k.shape and dq.dtype == q.dtype


@pytest.mark.gpu
def test_torch_work_goes_on_torch_current_stream_without_synchronizing(rng):
    """On a side stream, q is written only after a long GPU sleep: a kernel on any other stream
    would read it too early, and a synchronization would make the call wait out the sleep."""
    torch = pytest.importorskip("torch", reason="torch is not installed")

    q_source, k, v = _torch_qkv(_torch_generator(rng))
    expected = ptxattn.attention(q_source, k, v, causal=True)  # also compiles the kernel
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        q = torch.zeros_like(q_source)
        torch.cuda._sleep(2_000_000_000)  # about a second of GPU time
        q.copy_(q_source)
        out = ptxattn.attention(q, k, v, causal=True)
        still_sleeping = not side.query()
        total = out.float().sum()  # queued after ptxattn's kernel on the same stream
    side.synchronize()
    assert still_sleeping, "the call waited for the GPU"
    assert torch.equal(out, expected)
    assert float(total) == float(expected.float().sum())


@pytest.mark.gpu
def test_torch_requires_grad_is_refused_with_a_pointer_to_ptxattn_torch(rng):
    torch = pytest.importorskip("torch", reason="torch is not installed")

    q, k, v = _torch_qkv(_torch_generator(rng))
    with pytest.raises(TypeError, match=r"q requires grad.*ptxattn.torch.*q.detach\(\)"):
        ptxattn.attention(q.requires_grad_(), k, v)


@pytest.mark.gpu
def test_torch_fp8_round_trip(rng):
    """fp8.quantize of torch input gives float8_e4m3fn tensors, which fp8.attention takes."""
    torch = pytest.importorskip("torch", reason="torch is not installed")
    from ptxattn.runtime import device_arch

    if device_arch() not in fp8.ARCHS:
        pytest.skip(f"FP8 attention does not run on {device_arch()}")
    q, k, v = _torch_qkv(_torch_generator(rng))
    q8, k8, v8, descales = fp8.quantize_qkv(q, k, v)
    assert q8.dtype == torch.float8_e4m3fn and descales["q_descale"].dtype == torch.float32
    out = fp8.attention(q8, k8, v8, **descales)
    cupy_descales = {name: _cupy(d) for name, d in descales.items()}
    expected = fp8.attention(*(fp8.E4M3Array(_cupy(x.view(torch.uint8))) for x in (q8, k8, v8)),
                             **cupy_descales)
    assert isinstance(out, torch.Tensor) and torch.equal(out, torch.from_dlpack(expected))


# ---------------------------------------------------------------------------------------------
# GPU: JAX


@pytest.mark.gpu
def test_jax_in_jax_out(rng):
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # leave memory to CuPy
    jax = pytest.importorskip("jax", reason="jax is not installed")
    import cupy
    import jax.numpy as jnp

    if not any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("JAX sees no GPU")
    shapes = [(2, 300, 4, 128), (2, 300, 2, 128), (2, 300, 2, 128)]
    q, k, v = (jnp.asarray(rng.standard_normal(s, dtype=np.float32), dtype=jnp.bfloat16)
               for s in shapes)
    out, lse = ptxattn.attention(q, k, v, causal=True, return_lse=True)
    assert isinstance(out, jax.Array) and out.dtype == jnp.bfloat16 and lse.shape == (2, 4, 300)
    expected = ptxattn.attention(*(cupy.from_dlpack(x) for x in (q, k, v)), causal=True)
    assert bool((cupy.from_dlpack(out) == expected).all())
