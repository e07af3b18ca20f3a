"""Block-scaled attention: the MMA against a model of the PTX ISA, the kernel against FP32.

CPU: every native sm_120a and emulated sm_90a variant compiles without spills within its
shared memory; argument checks; the ISA model's own consistency.
GPU (sm_90a runs the emulation build, sm_120a the native one): the block-scaled MMA on random
fragments, scales and selectors against the model; whole kernels against an FP32 reference of
the dequantized inputs.

``python tests/test_blockscaled.py`` prints the error report of docs/guide/blockscaled.md.
"""

import dataclasses
import math
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from probe_kernels import probe_spec
from ptxattn import blockscaled, runtime
from ptxattn.launchers import blockscaled as launcher
from ptxattn.quant import blockscaled as quant
from ptxattn.problem import AttentionProblem

# ---------------------------------------------------------------------------------------------
# Compilation and argument checks (no GPU)


def test_variants_cover_native_and_emulated_builds():
    kernels = [s for s in launcher.variants() if s.source == "kernels/fwd_blockscaled.cu"]
    assert {(s.entry, s.archs) for s in kernels} == {
        (f"ptxattn::attn_fwd_blockscaled<{d}, {nvfp4}>", a) for nvfp4 in ("false", "true")
        for d in (64, 128) for a in (("sm_120a", "sm_121a"), ("sm_90a",))}
    for s in kernels:
        assert s.defines["PTXATTN_EMULATE_BLOCK_SCALE"] == (s.archs == ("sm_90a",))
        assert s.smem_bytes <= 99 * 1024


def block_scale_probe(fmt, emulate):
    """One block-scaled MMA per warp on given fragments (tests/probes/block_scale_mma_probe.cu):
    natively on sm_120a/sm_121a, or through the emulation on sm_90a."""
    return probe_spec(f"block_scale_probe_{fmt}_{'emulated' if emulate else 'native'}",
                      "block_scale_mma_probe.cu", f"block_scale_probe_{fmt}",
                      ("sm_90a",) if emulate else ("sm_120a", "sm_121a"),
                      defines={"PTXATTN_EMULATE_BLOCK_SCALE": int(emulate)})


@pytest.mark.parametrize("emulate", [False, True], ids=["native", "emulated"])
@pytest.mark.parametrize("fmt", launcher.FORMATS)
def test_block_scale_probe_compiles(fmt, emulate):
    """For its first architecture, without spills where this NVRTC reports ptxas's numbers
    (13.5 does, 13.0 does not)."""
    spec = block_scale_probe(fmt, emulate)
    compiled = runtime.compile(spec, spec.archs[0])
    assert compiled.cubin[:4] == b"\x7fELF"
    if compiled.report is not None:
        assert compiled.spill_bytes == 0


def test_build_for_arch():
    assert launcher.build_for_arch("sm_120a") == "native"
    assert launcher.build_for_arch("sm_121a") == "native"
    assert launcher.build_for_arch("sm_90a") == "emulated"
    with pytest.raises(RuntimeError, match="sm_120a/sm_121a .native. or sm_90a"):
        launcher.build_for_arch("sm_80")


@dataclasses.dataclass
class _Ptr:
    ptr: int


@dataclasses.dataclass
class _Device:
    id: int


class Meta:
    """A CuPy array's metadata without its contents."""

    def __init__(self, shape, dtype="uint8", ptr=1 << 20):
        self.shape = tuple(shape)
        self.dtype = np.dtype(dtype) if dtype != "bfloat16" else dtype
        self.itemsize = 1 if dtype == "uint8" else 2 if dtype == "bfloat16" else 4
        self.ndim = len(self.shape)
        self.size = int(np.prod(self.shape))
        strides, step = [], self.itemsize
        for n in reversed(self.shape):
            strides.insert(0, step)
            step *= n
        self.strides = tuple(strides)
        self.data = _Ptr(ptr)
        self.device = _Device(0)


def _operands(fmt="mxfp8", batch=2, sq=100, sk=300, hq=4, hkv=2, d=128):
    row, per = (d // 2, 16) if fmt == "nvfp4" else (d, 32)
    pad = -(-sk // 128) * 128
    return dict(q=Meta((batch, sq, hq, row)), k=Meta((batch, sk, hkv, row)),
                v=Meta((batch, hkv, d, pad)), q_scale=Meta((batch, sq, hq, d // per)),
                k_scale=Meta((batch, sk, hkv, d // per)), v_scale=Meta((batch, hkv, d, pad // 32)))


def test_valid_operands_pass():
    p = AttentionProblem.from_blockscaled(**_operands(), format="mxfp8")
    assert (p.head_dim, p.padded_seqlen_k, p.softmax_scale) == (128, 384, 1 / math.sqrt(128))
    p = AttentionProblem.from_blockscaled(**_operands("nvfp4", d=64), format="nvfp4",
                                          q_tensor_scale=0.5, k_tensor_scale=Meta((1,), "float32"))
    assert (p.head_dim, p.heads_kv) == (64, 2)


@pytest.mark.parametrize("change, error, message", [
    (dict(q_scale=Meta((2, 100, 4, 4), "float32")), TypeError, r"q_scale must be uint8"),
    (dict(k=Meta((2, 300, 2, 128), "bfloat16")), TypeError, r"k must be uint8"),
    (dict(k_scale=Meta((2, 300, 2, 8))), ValueError, r"k_scale must have shape \(2, 300, 2, 4\)"),
    (dict(v=Meta((2, 300, 2, 128))), ValueError, r"v must have shape \(2, 2, 128, 384\)"),
    (dict(v_scale=Meta((2, 2, 128, 10))), ValueError, r"v_scale must have shape \(2, 2, 128, 12\)"),
    (dict(q=Meta((2, 100, 3, 128)), q_scale=Meta((2, 100, 3, 4))), ValueError, "multiple of"),
    (dict(q=Meta((2, 100, 4, 96)), q_scale=Meta((2, 100, 4, 3))), ValueError, "head_dim must be"),
    (dict(q=Meta((2, 100, 4, 128), ptr=(1 << 20) + 8)), ValueError, "16-byte aligned"),
])
def test_bad_operands_are_clear_errors(change, error, message):
    args = {**_operands(), **change}
    with pytest.raises(error, match=message):
        AttentionProblem.from_blockscaled(**args, format="mxfp8")


def test_tensor_scales_belong_to_nvfp4_only():
    with pytest.raises(ValueError, match="MXFP8 has no per-tensor scale"):
        AttentionProblem.from_blockscaled(**_operands(), format="mxfp8", q_tensor_scale=1.0)
    with pytest.raises(ValueError, match="needs k_tensor_scale"):
        AttentionProblem.from_blockscaled(**_operands("nvfp4"), format="nvfp4",
                                          q_tensor_scale=1.0)
    with pytest.raises(TypeError, match="1-element float32"):
        AttentionProblem.from_blockscaled(**_operands("nvfp4"), format="nvfp4",
                                          q_tensor_scale=1.0, k_tensor_scale=Meta((2,), "float32"))
    with pytest.raises(ValueError, match="format must be one of"):
        AttentionProblem.from_blockscaled(**_operands(), format="mxfp4")


def test_mxfp8_shaped_operands_are_refused_as_nvfp4():
    with pytest.raises(ValueError, match="head_dim must be one of"):
        AttentionProblem.from_blockscaled(**_operands("mxfp8"), format="nvfp4",
                                          q_tensor_scale=1.0, k_tensor_scale=1.0)


# ---------------------------------------------------------------------------------------------
# A model of the PTX ISA's block-scaled mma.sync (9.7.14.3, fragments 9.7.14.5.10/11)


def _e4m3(byte_array):
    return np.asarray(byte_array, np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)


def _e2m1(nibbles):
    return np.asarray(nibbles, np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float64)


def _bytes(reg):
    """(..., 4) bytes of uint32 registers, lowest first."""
    reg = np.asarray(reg, np.uint32)
    return (reg[..., None] >> np.array([0, 8, 16, 24], np.uint32)) & 0xFF


def _nibbles(reg):
    reg = np.asarray(reg, np.uint32)
    return (reg[..., None] >> (4 * np.arange(8, dtype=np.uint32))) & 0xF


LANES = np.arange(32)
G, T = LANES // 4, LANES % 4


def _accumulator(c):
    """(32, 4) per-lane C fragment to a 16 x 8 matrix, and back (C/D layout)."""
    m = np.zeros((16, 8))
    for i in range(4):
        m[G + 8 * (i // 2), 2 * T + i % 2] = c[:, i]
    return m


def _fragment(m):
    return np.stack([m[G + 8 * (i // 2), 2 * T + i % 2] for i in range(4)], axis=1)


def model_mma(fmt, a, b, c, sfa, sfb, byte_a, thread_a, byte_b, thread_b):
    """D fragment (32, 4) float64 of the block-scaled MMA on per-lane registers a (32, 4),
    b (32, 2), c (32, 4), sfa, sfb (32,) with immediates (byte_a, thread_a, byte_b, thread_b)."""
    if fmt == "mxfp8":
        k, per_reg, element = 32, 4, lambda r: _e4m3(_bytes(r))
    else:
        k, per_reg, element = 64, 8, lambda r: _e2m1(_nibbles(r))
    A, B = np.zeros((16, k)), np.zeros((k, 8))
    for r in range(4):  # a_r: rows g (+8 for odd r), k = per_reg t .. (+ k/2 for r >= 2)
        cols = per_reg * T[:, None] + np.arange(per_reg) + (k // 2) * (r // 2)
        A[(G + 8 * (r % 2))[:, None], cols] = element(a[:, r])
    for r in range(2):
        rows = per_reg * T[:, None] + np.arange(per_reg) + (k // 2) * r
        B[rows, G[:, None]] = element(b[:, r])
    m, n = np.arange(16), np.arange(8)
    row_lane = 4 * (m % 8) + 2 * thread_a + m // 8  # figure 43
    col_lane = 4 * n + thread_b                     # figure 44
    if fmt == "mxfp8":  # scale_vec::1X: byte byte-id scales all 32 k
        sa = quant.decode_ue8m0(_bytes(sfa[row_lane])[:, byte_a].astype(np.uint8))[:, None]
        sb = quant.decode_ue8m0(_bytes(sfb[col_lane])[:, byte_b].astype(np.uint8))[None, :]
        A, B = A * sa, B * sb
    else:  # scale_vec::4X: byte j scales k = 16j .. 16j + 15
        sa = quant.decode_ue4m3(_bytes(sfa[row_lane]).astype(np.uint8))      # (16, 4)
        sb = quant.decode_ue4m3(_bytes(sfb[col_lane]).astype(np.uint8)).T    # (4, 8)
        A = A * np.repeat(sa, 16, axis=1)
        B = B * np.repeat(sb, 16, axis=0)
    return _fragment(A @ B + _accumulator(c)), np.abs(A) @ np.abs(B) + np.abs(_accumulator(c))


def random_fragments(fmt, rng):
    """Random registers: finite e4m3 / any e2m1 data, scales within 2^+-6 (UE8M0) or any finite
    UE4M3, FP32 accumulators."""
    if fmt == "mxfp8":
        data = rng.integers(0, 256, (32, 6, 4), dtype=np.uint8)
        data[(data & 0x7F) == 0x7F] = 0x3C  # no NaN codes
        scales = rng.integers(121, 134, (32, 2, 4), dtype=np.uint8)
    else:
        data = rng.integers(0, 256, (32, 6, 4), dtype=np.uint8)
        scales = rng.integers(0x08, 0x7F, (32, 2, 4), dtype=np.uint8)
    regs = data.view(np.uint32).reshape(32, 6)
    sf = scales.view(np.uint32).reshape(32, 2)
    c = rng.standard_normal((32, 4)).astype(np.float32) * 4
    return regs[:, :4].copy(), regs[:, 4:].copy(), c, sf[:, 0].copy(), sf[:, 1].copy()


def selectors(fmt):
    if fmt == "mxfp8":
        return [(ba, ta, bb, tb) for ba in range(4) for ta in range(2) for bb in range(4)
                for tb in range(4)]
    return [(0, ta, 0, tb) for ta in range(2) for tb in range(4)]


def test_model_reads_scales_where_the_isa_puts_them(rng):
    """Matrices and scales placed into registers by the ISA's rules come back as the model's
    product: the model's decode is the inverse of an independent placement."""
    A = rng.integers(-3, 4, (16, 32)).astype(np.float64)
    B = rng.integers(-3, 4, (32, 8)).astype(np.float64)
    ea, eb = rng.integers(-3, 4, 16), rng.integers(-3, 4, 8)
    byte_a, thread_a, byte_b, thread_b = 2, 1, 3, 2
    code = {float(v): i for i, v in enumerate(_e4m3(np.arange(256))) if np.isfinite(v)}
    a = np.zeros((32, 4), np.uint32)
    b = np.zeros((32, 2), np.uint32)
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for r in range(4):
            for i in range(4):
                a[lane, r] |= code[A[g + 8 * (r % 2), 4 * t + 16 * (r // 2) + i]] << (8 * i)
        for r in range(2):
            for i in range(4):
                b[lane, r] |= code[B[4 * t + 16 * r + i, g]] << (8 * i)
    sfa = np.zeros(32, np.uint32)
    sfb = np.zeros(32, np.uint32)
    for m in range(16):
        sfa[4 * (m % 8) + 2 * thread_a + m // 8] = (127 + ea[m]) << (8 * byte_a)
    for n in range(8):
        sfb[4 * n + thread_b] = (127 + eb[n]) << (8 * byte_b)
    d, _ = model_mma("mxfp8", a, b, np.zeros((32, 4), np.float32), sfa, sfb, byte_a, thread_a,
                     byte_b, thread_b)
    expected = (A * 2.0 ** ea[:, None]) @ (B * 2.0 ** eb[None, :])
    np.testing.assert_array_equal(_accumulator(d), expected)


# ---------------------------------------------------------------------------------------------
# GPU: the block-scaled MMA against the model


def _device_build():
    return launcher.build_for_arch(runtime.device_arch())


def _run_probe(fmt, cases):
    import cupy

    spec = block_scale_probe(fmt, _device_build() == "emulated")
    a, b, c, sfa, sfb, sel = (cupy.asarray(np.stack(x)) for x in zip(*cases))
    d = cupy.empty((len(cases), 32, 4), cupy.float32)
    runtime.launch(runtime.load(spec), (len(cases),), (32,),
                   [a, b, c, sfa, sfb, sel.astype(cupy.int32), d])
    return d.get()


def _selector_index(fmt, byte_a, thread_a, byte_b, thread_b):
    if fmt == "mxfp8":
        return ((byte_a * 2 + thread_a) * 4 + byte_b) * 4 + thread_b
    return thread_a * 4 + thread_b


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
def test_block_scaled_mma_matches_isa_model(fmt, rng):
    cases, expected = [], []
    for sel in selectors(fmt) * (2 if fmt == "mxfp8" else 8):
        a, b, c, sfa, sfb = random_fragments(fmt, rng)
        cases.append((a, b, c, sfa, sfb, np.int32(_selector_index(fmt, *sel))))
        expected.append((sel, *model_mma(fmt, a, b, c, sfa, sfb, *sel)))
    got = _run_probe(fmt, cases)
    wrong_selector_differs = 0
    for d, (sel, ref, magnitude), case in zip(got, expected, cases):
        # FP32 accumulation of up to 64 products: a few ulps of the sum of magnitudes.
        tolerance = float(magnitude.max()) * 2.0 ** -16
        np.testing.assert_allclose(d, ref, rtol=0, atol=tolerance, err_msg=f"selectors {sel}")
        other = ((sel[0] + 1) % 4 if fmt == "mxfp8" else 0, 1 - sel[1],
                 (sel[2] + 1) % 4 if fmt == "mxfp8" else 0, (sel[3] + 1) % 4)
        wrong, _ = model_mma(fmt, *case[:5], *other)
        wrong_selector_differs += not np.allclose(d, wrong, rtol=0, atol=tolerance)
    assert wrong_selector_differs == len(cases), "the check would not notice swapped selectors"


# ---------------------------------------------------------------------------------------------
# GPU: whole kernels against FP32 on the dequantized inputs


def make_inputs(rng, batch, sq, sk, hq, hkv, d, kind):
    """bf16-representable float32 q, k, v. 'outlier': a few huge channels in K, rare huge
    entries in Q, and V whose magnitude jumps by up to 2^+-8 between 32-key blocks."""
    q = rng.standard_normal((batch, sq, hq, d)).astype(np.float32)
    k = rng.standard_normal((batch, sk, hkv, d)).astype(np.float32)
    v = rng.standard_normal((batch, sk, hkv, d)).astype(np.float32)
    if kind == "outlier":
        k[..., rng.choice(d, 4, replace=False)] *= 20.0
        q *= np.where(rng.random(q.shape) < 1e-3, 50.0, 1.0).astype(np.float32)
        blocks = -(-sk // 32)
        jump = np.exp2(rng.integers(-8, 9, (batch, blocks, hkv, d))).astype(np.float32)
        v *= np.repeat(jump, 32, axis=1)[:, :sk]
    return tuple(x.astype(ml_dtypes.bfloat16).astype(np.float32) for x in (q, k, v))


def attention_fp64(q, k, v, causal, scale, p_round=None):
    """Reference attention in float64 (q (B, Sq, Hq, D), k/v (B, Sk, Hkv, D)); p_round, if given,
    rounds the unnormalised probabilities that multiply V (the row sum stays exact)."""
    group = q.shape[2] // k.shape[2]
    qh = q.transpose(0, 2, 1, 3).astype(np.float64)
    kh = np.repeat(k.transpose(0, 2, 1, 3), group, axis=1).astype(np.float64)
    vh = np.repeat(v.transpose(0, 2, 1, 3), group, axis=1).astype(np.float64)
    s = scale * qh @ kh.transpose(0, 1, 3, 2)
    sq, sk = q.shape[1], k.shape[1]
    if causal:
        hidden = np.arange(sk)[None, :] > np.arange(sq)[:, None] + (sk - sq)
        s = np.where(hidden, -np.inf, s)
    m = s.max(-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    p = np.exp(s - m)
    l = p.sum(-1, keepdims=True)
    pv = p if p_round is None else p_round(p)
    with np.errstate(invalid="ignore", divide="ignore"):
        out = np.where(l > 0, (pv @ vh) / np.where(l > 0, l, 1), 0.0)
        lse = np.where(l[..., 0] > 0, m[..., 0] + np.log(l[..., 0]), -np.inf)
    return out.transpose(0, 2, 1, 3), lse


def round_p_e4m3(p):
    """P as the kernel feeds it to the MMA: e4m3 of 2^8 p, scaled back by 2^-8."""
    return (p * 256).astype(np.float32).astype(ml_dtypes.float8_e4m3fn).astype(np.float64) / 256


def dequantized(inputs, fmt, seqlen_k):
    """Host float32 Q, K, V as the kernel sees them."""
    if fmt == "mxfp8":
        q = quant.decode_mxfp8(inputs["q"].get(), inputs["q_scale"].get())
        k = quant.decode_mxfp8(inputs["k"].get(), inputs["k_scale"].get())
    else:
        q = quant.decode_nvfp4(inputs["q"].get(), inputs["q_scale"].get(),
                               inputs["q_tensor_scale"].get()[0])
        k = quant.decode_nvfp4(inputs["k"].get(), inputs["k_scale"].get(),
                               inputs["k_tensor_scale"].get()[0])
    v = quant.decode_mxfp8_v(inputs["v"].get(), inputs["v_scale"].get(), seqlen_k)
    return q, k, v


def run_kernel(q, k, v, fmt, causal):
    import cupy

    inputs = quant.quantize_qkv(*(cupy.asarray(x).astype("bfloat16") for x in (q, k, v)), fmt)
    with pytest.warns(RuntimeWarning, match="emulation") if _device_build() == "emulated" \
            else _no_warning():
        out, lse = blockscaled.blockscaled_attention(**inputs, causal=causal)
    return inputs, out.astype(cupy.float32).get(), lse.get()


class _no_warning:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


SEQLENS = [(1, 1), (77, 200), (256, 256), (300, 130)]


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlens", SEQLENS, ids=lambda p: f"{p[0]}x{p[1]}")
@pytest.mark.parametrize("kind", ["normal", "outlier"])
def test_kernel_matches_fp32_on_dequantized_inputs(fmt, head_dim, causal, seqlens, kind, rng):
    sq, sk = seqlens
    q, k, v = make_inputs(rng, 2, sq, sk, 4, 2, head_dim, kind)
    inputs, out, lse = run_kernel(q, k, v, fmt, causal)
    qd, kd, vd = dequantized(inputs, fmt, sk)
    scale = 1 / math.sqrt(head_dim)
    ref, ref_lse = attention_fp64(qd, kd, vd, causal, scale)
    naive, _ = attention_fp64(qd, kd, vd, causal, scale, p_round=round_p_e4m3)

    assert np.isfinite(out).all(), "output has NaN/Inf"
    noise = np.abs(ref.astype(ml_dtypes.bfloat16).astype(np.float64) - ref).max()
    err = np.abs(out - ref).max()
    naive_err = np.abs(naive - ref).max()
    assert err <= 2 * naive_err + 2 * noise + 1e-6, (err, naive_err, noise)

    visible = np.isfinite(ref_lse)
    assert (np.isfinite(lse) == visible).all(), "LSE -inf pattern differs"
    assert (out[~visible.transpose(0, 2, 1)] == 0).all(), "rows that see no key must be 0"
    lse_err = np.abs(np.where(visible, lse, 0) - np.where(visible, ref_lse, 0)).max()
    assert lse_err <= 1e-3 * max(1.0, np.abs(ref_lse[visible]).max(initial=0)), lse_err


@pytest.mark.gpu
def test_gpu_operands_with_wrong_dtype_are_refused():
    import cupy

    q = cupy.zeros((1, 16, 2, 64), "bfloat16")
    inputs = quant.quantize_qkv(q, q, q, "mxfp8")
    inputs["k_scale"] = inputs["k_scale"].astype(cupy.int8)
    with pytest.raises(TypeError, match="k_scale must be uint8"):
        blockscaled.blockscaled_attention(**inputs)


# ---------------------------------------------------------------------------------------------
# Error report (python tests/test_blockscaled.py)


def _errors(out, ref):
    diff = out - ref
    return (np.abs(diff).max(), np.sqrt((diff ** 2).sum() / (ref ** 2).sum()))


def _nvfp4_seq(x):
    """Host NVFP4 of x (B, S, H, D) with blocks along the sequence (keys), dequantized."""
    s = x.shape[1]
    pad = -(-s // 16) * 16
    xt = np.zeros((*x.shape[:1], *x.shape[2:], pad), np.float32)
    xt[..., :s] = x.transpose(0, 2, 3, 1)
    return quant.decode_nvfp4(*quant.encode_nvfp4(xt))[..., :s].transpose(0, 3, 1, 2)


def report(batch=1, seqlen=1024, heads=(4, 2), head_dim=128, causal=False, seed=0):
    import cupy

    from ptxattn import reference

    rng = np.random.default_rng(seed)
    scale = 1 / math.sqrt(head_dim)
    print(f"device {cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}, build "
          f"{_device_build()}; batch {batch}, seqlen {seqlen}, heads {heads}, head_dim "
          f"{head_dim}, causal {causal}\n")
    print("| inputs | path | max abs err | rel RMS err |")
    print("|---|---|---|---|")
    for kind in ("normal", "outlier"):
        q, k, v = make_inputs(rng, batch, seqlen, seqlen, *heads, head_dim, kind)
        exact, _ = attention_fp64(q, k, v, causal, scale)
        qb, kb, vb = (cupy.asarray(x).astype("bfloat16") for x in (q, k, v))
        naive = reference.attention(qb, kb, vb, causal=causal, precision="input").get()
        rows = [("bf16 inputs, naive bf16 math (yardstick)", naive)]
        for fmt in ("mxfp8", "nvfp4"):
            inputs, out, _ = run_kernel(q, k, v, fmt, causal)
            qd, kd, vd = dequantized(inputs, fmt, seqlen)
            rows.append((f"{fmt} kernel", out))
            rows.append((f"{fmt} inputs, FP32 math", attention_fp64(qd, kd, vd, causal, scale)[0]))
            if fmt == "nvfp4":
                rows.append(("nvfp4 Q/K, bf16 P and V (simulated)", attention_fp64(
                    qd, kd, v, causal, scale,
                    p_round=lambda p: p.astype(ml_dtypes.bfloat16).astype(np.float64))[0]))
                rows.append(("nvfp4 Q/K, e2m1 P and NVFP4 V along keys (simulated)",
                             attention_fp64(qd, kd, _nvfp4_seq(v), causal, scale,
                                            p_round=lambda p: _nvfp4_p(p))[0]))
        for name, out in rows:
            print(f"| {kind} | {name} | {_errors(out, exact)[0]:.3e} | "
                  f"{_errors(out, exact)[1]:.3e} |")


def _nvfp4_p(p):
    """P (B, H, Sq, Sk) float64 as NVFP4 along the keys with per-row tensor scale 1/2688."""
    sk = p.shape[-1]
    pad = -(-sk // 16) * 16
    pp = np.zeros((*p.shape[:-1], pad), np.float32)
    pp[..., :sk] = p
    packed, scales, g = quant.encode_nvfp4(pp)
    return quant.decode_nvfp4(packed, scales, g)[..., :sk].astype(np.float64)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    report()
    report(causal=True, seqlen=1000)
