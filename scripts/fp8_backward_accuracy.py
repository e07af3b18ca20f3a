"""Which GEMMs of an attention backward can take e4m3 operands: the gradients' error, emulated.

    python scripts/fp8_backward_accuracy.py [--seqlen 1024] [--heads 4] [--head-dim 128]
                                            [--causal] [--seed 0] [--gpu]

Needs no GPU (NumPy and ml_dtypes), except with --gpu, which measures the backward passes that
run instead of emulating recipes (below). Inputs are bf16 q, k, v and dO, standard normal, and the
same with 0.1% of their values times 10 ("outliers"). Every recipe is compared with the FP32
gradients of the same bf16 inputs (autograd's formulas, float64 here), as the relative RMSE
of dq, dk and dv: ||g - g_ref|| / ||g_ref||.

The forward is ptxattn's FP8 forward: q, k, v quantized per block of 128 rows and head
(amax / 448, ``fp8.quantize(x, "block")``), and its output and LSE from those values. A
backward GEMM "in e4m3" multiplies e4m3 values (products exact) and sums them in float32; an
e4m3 operand the forward did not quantize is quantized on the fly:

    P   e4m3(448 P), descale 1/448 (P <= 1: the range is known, no amax pass)
    dO  per 128-row block and head, amax / 448
    dS  per 128-row block and head, amax / 448 (its rows are queries)

Recipes (the GEMM operands; "16" is the queries' 16-bit format, bf16):
    bf16          every GEMM in bf16 from the bf16 inputs (ptxattn's bf16 backward)
    fp8-fwd       bf16 GEMMs, but S recomputed from the e4m3 q, k the forward used
    dV            + dV = P^T dO in e4m3
    dV,dP         + dP = dO V^T in e4m3
    dV,dP,dQK     + dQ = dS K and dK = dS^T Q in e4m3 (everything)
    all+rotation  everything, q and k rotated by one random-sign Hadamard R before they are
                  quantized (fp8.hadamard_rotation: S is unchanged; dq, dk rotated back by R^T)
    ptxattn       ptxattn's FP8 backward (kernel_backward): dV, dP and dK in e4m3, P as
                  e4m3(256 P), dS per key row and query tile, dQ in bf16

The emulation sums in float32 in NumPy's order; an FP8 wgmma sums with less precision (about 14
bits kept, DeepSeek-V3's report for the H800), which only a GPU run measures.

--gpu: the same inputs and reference, causal and not, through the backward passes that run on
the GPU (torch needed; cuDNN's needs the nvidia-cudnn-frontend wheel, and is left out with the
reason where it cannot run):

    ptxattn bf16          ptxattn.attention_backward on the bf16 inputs
    ptxattn FP8           fp8.attention_backward after fp8.quantize_qkv(q, k, v, "block")
    ptxattn FP8 rotated   the same with rotate=True (dq, dk rotated back by R^T)
    cuDNN FP8             cuDNN's FP8 backward (ptxattn/tools/cudnn_fp8.py): q, k, v and dO
                          per tensor, e4m3 gradients dequantized
"""

from __future__ import annotations

import argparse

import ml_dtypes
import numpy as np

from ptxattn.quant.hadamard import hadamard_rotation

E4M3 = ml_dtypes.float8_e4m3fn
E4M3_MAX = 448.0
FLOAT32_LEAST_NORMAL = float(np.finfo(np.float32).tiny)
BLOCK = 128


def bf16(x):
    return x.astype(ml_dtypes.bfloat16).astype(np.float64)


def e4m3(x):
    """x rounded to e4m3 (saturated at +-448), as float64."""
    return np.clip(x, -E4M3_MAX, E4M3_MAX).astype(np.float32).astype(E4M3).astype(np.float64)


def quantize_blocks(x):
    """x (heads, seqlen, cols) as e4m3 values times per-(head, 128-row block) descales."""
    heads, seqlen, _ = x.shape
    out = np.empty_like(x)
    for start in range(0, seqlen, BLOCK):
        block = x[:, start:start + BLOCK]
        amax = np.abs(block).max(axis=(1, 2), keepdims=True)
        d = np.where(amax > 0, amax / E4M3_MAX, 1.0)
        out[:, start:start + BLOCK] = e4m3(block / d) * d
    return out


def gemm(a, b):
    """a @ b summed in float32 (operands already rounded to their format)."""
    return (a.astype(np.float32) @ b.astype(np.float32)).astype(np.float64)


def forward(q, k, v, scale, causal):
    s = q @ k.transpose(0, 2, 1) * scale
    if causal:
        s = np.where(np.tril(np.ones(s.shape[1:], bool)), s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    p = np.exp(s - m)
    lse = m + np.log(p.sum(axis=-1, keepdims=True))
    return np.exp(s - lse) @ v, lse


def backward(q, k, v, o, lse, do, scale, causal, *, rounding, e4m3_gemms=()):
    """dq, dk, dv by autograd's formulas; ``rounding`` rounds a GEMM operand to its 16-bit
    format, the GEMMs named in e4m3_gemms take e4m3 operands ("dv", "dp", "dqk")."""
    s = gemm(q, k.transpose(0, 2, 1)) * scale
    if causal:
        s = np.where(np.tril(np.ones(s.shape[1:], bool)), s, -np.inf)
    p = np.exp(s - lse)
    d = (do * o).sum(axis=-1, keepdims=True)
    do8 = quantize_blocks(do) if {"dv", "dp"} & set(e4m3_gemms) else None
    if "dv" in e4m3_gemms:
        dv = gemm(e4m3(E4M3_MAX * p).transpose(0, 2, 1) / E4M3_MAX, do8)
    else:
        dv = gemm(rounding(p).transpose(0, 2, 1), rounding(do))
    dp = (gemm(do8, v.transpose(0, 2, 1)) if "dp" in e4m3_gemms
          else gemm(rounding(do), v.transpose(0, 2, 1)))
    ds = p * (dp - d)
    ds = quantize_blocks(ds) if "dqk" in e4m3_gemms else rounding(ds)
    dq = gemm(ds, k) * scale
    dk = gemm(ds.transpose(0, 2, 1), q) * scale
    return dq, dk, dv


def kernel_backward(q, k, v, o, lse, do, scale, causal, *, block_m, rounding=bf16):
    """dq, dk, dv as ptxattn's FP8 backward computes them (fp8.attention_backward, the kernel's
    kFp8 build, ptx_src/mainloops/bwd_sm90.cuh), from the e4m3 inputs' values q, k, v, the
    forward's output o and LSE (both rounded as the kernel received them) and the 16-bit dO:

        dV = e4m3(256 16(P))^T e4m3(dO) / 256  dO per 128-row block and head, amax / 448
        dP = e4m3(dO) V^T                      (V as given: e4m3 values)
        dS = 16(16(P) (dP - D))                P and dS rounded to 16 bits, as dQ's GEMM reads dS
        dK = sum over query tiles of block_m rows: e4m3(dS^T / a) Q * a, a = amax / 448 per
             key row and tile (of dS before its 16-bit rounding) rounded up to a power of two,
             at least FP32's least normal value
        dQ = 16(dS) 16(K)                      dQ's GEMM in 16 bits, K dequantized
    """
    s = gemm(q, k.transpose(0, 2, 1)) * scale
    if causal:
        s = np.where(np.tril(np.ones(s.shape[1:], bool), s.shape[2] - s.shape[1]), s, -np.inf)
    p = np.where(np.isneginf(s), 0.0, np.exp(s - lse))  # a row that sees no key: LSE -inf, P 0
    d = (do * o).sum(axis=-1, keepdims=True)
    do8 = quantize_blocks(do)
    dv = gemm(e4m3(256 * rounding(p)).transpose(0, 2, 1) / 256, do8)
    dp = gemm(do8, v.transpose(0, 2, 1))
    ds_exact = rounding(p) * (dp - d)
    ds = rounding(ds_exact)
    dk = np.zeros_like(k)
    for start in range(0, q.shape[1], block_m):
        tile = ds[:, start:start + block_m].transpose(0, 2, 1)  # (heads, keys, tile queries)
        amax = np.abs(ds_exact[:, start:start + block_m]).max(axis=1)[..., None]
        unit = 2.0 ** np.ceil(np.log2(np.maximum(amax / E4M3_MAX, FLOAT32_LEAST_NORMAL)))
        dk += gemm(e4m3(tile / unit), q[:, start:start + block_m]) * unit
    dq = gemm(ds, rounding(k)) * scale
    return dq, dk * scale, dv


ALL = ("dv", "dp", "dqk")
RECIPES = {"bf16": None, "fp8-fwd": (), "dV": ("dv",), "dV,dP": ("dv", "dp"), "dV,dP,dQK": ALL,
           "all+rotation": ALL, "ptxattn": "kernel"}


def inputs(rng, heads, seqlen, head_dim, outliers: bool):
    def one():
        x = rng.standard_normal((heads, seqlen, head_dim))
        if outliers:
            mask = rng.random(x.shape) < 1e-3
            x = np.where(mask, x * 10, x)
        return bf16(x)
    return one(), one(), one(), one()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqlen", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--gpu", action="store_true",
                        help="measure the GPU backward passes (torch needed), causal and not")
    args = parser.parse_args(argv)
    if args.gpu:
        return gpu_main(args)
    scale = args.head_dim ** -0.5
    rng = np.random.default_rng(args.seed)
    print(f"# relative RMSE of (dq, dk, dv) against float64 autograd on the bf16 inputs; "
          f"heads {args.heads}, seqlen {args.seqlen}, head_dim {args.head_dim}, "
          f"causal {args.causal}, seed {args.seed}")
    print("| inputs | " + " | ".join(RECIPES) + " |")
    print("|---|" + "---|" * len(RECIPES))
    for outliers in (False, True):
        q, k, v, do = inputs(rng, args.heads, args.seqlen, args.head_dim, outliers)
        o_ref, lse_ref = forward(q, k, v, scale, args.causal)
        refs = backward(q, k, v, o_ref, lse_ref, do, scale, args.causal,
                        rounding=lambda x: x)
        rotation = hadamard_rotation(args.head_dim, seed=args.seed).matrix()
        cells = []
        for name, gemms in RECIPES.items():
            if gemms is None:  # the bf16 backward of the bf16 forward
                o, lse = forward(q, k, v, scale, args.causal)
                got = backward(q, k, v, bf16(o), lse, do, scale, args.causal, rounding=bf16)
            else:
                r = rotation if name == "all+rotation" else np.eye(args.head_dim)
                q8, k8, v8 = (quantize_blocks(x) for x in (q @ r, k @ r, v))
                o8, lse8 = forward(q8, k8, v8, scale, args.causal)
                if gemms == "kernel":
                    dq, dk, dv = kernel_backward(q8, k8, v8, bf16(o8), lse8, do, scale,
                                                 args.causal, block_m=64 if args.head_dim > 64
                                                 else 128)
                else:
                    dq, dk, dv = backward(q8, k8, v8, bf16(o8), lse8, do, scale, args.causal,
                                          rounding=bf16, e4m3_gemms=gemms)
                got = (dq @ r.T, dk @ r.T, dv)
            errors = [np.linalg.norm(g - r) / np.linalg.norm(r) for g, r in zip(got, refs)]
            cells.append(" / ".join(f"{e:.4f}" for e in errors))
        print(f"| {'0.1% outliers x10' if outliers else 'normal'} | " + " | ".join(cells) + " |")
    return 0


def _gpu_grads(q, k, v, do, causal: bool, seed: int) -> dict:
    """Every GPU backward of --gpu on (heads, seqlen, dim) float64 bf16 values (batch 1): name
    -> (dq, dk, dv) as float64 arrays of the same layout, or the reason it did not run."""
    import cupy
    import torch

    from ptxattn import attention, attention_backward, fp8

    def device(x):  # (heads, seqlen, dim) -> (1, seqlen, heads, dim) bf16 on the GPU
        return cupy.asarray(x.transpose(1, 0, 2)[None].astype(np.float32)).astype("bfloat16")

    def host(x):
        x = cupy.asarray(x) if not isinstance(x, torch.Tensor) else cupy.from_dlpack(
            x.float().contiguous())
        return cupy.asnumpy(x.astype(cupy.float32))[0].transpose(1, 0, 2).astype(np.float64)

    qd, kd, vd, dod = (device(x) for x in (q, k, v, do))
    grads = {}
    out, lse = attention(qd, kd, vd, causal=causal, return_lse=True)
    grads["ptxattn bf16"] = [host(g) for g in attention_backward(dod, qd, kd, vd, out, lse,
                                                                 causal=causal)]
    for name, rotate in (("ptxattn FP8", False), ("ptxattn FP8 rotated", True)):
        rotation = hadamard_rotation(q.shape[2], seed)
        q8, qs = fp8.quantize(qd, "block", rotation if rotate else None)
        k8, ks = fp8.quantize(kd, "block", rotation if rotate else None)
        v8, vs = fp8.quantize(vd, "head")
        descales = {"q_descale": qs, "k_descale": ks, "v_descale": vs}
        out8, lse8 = fp8.attention(q8, k8, v8, causal=causal, return_lse=True, **descales)
        dq, dk, dv = (host(g) for g in fp8.attention_backward(dod, q8, k8, v8, out8, lse8,
                                                              causal=causal, **descales))
        r = rotation.matrix() if rotate else np.eye(q.shape[2])
        grads[name] = [dq @ r.T, dk @ r.T, dv]
    try:
        from ptxattn.tools import cudnn_fp8

        tq, tk, tv, tdo = (torch.from_dlpack(x) for x in (qd, kd, vd, dod))
        (q8, qs), (k8, ks), (v8, vs), (do8, dos) = (cudnn_fp8.quantize_per_tensor(x)
                                                    for x in (tq, tk, tv, tdo))
        fwd = cudnn_fp8.forward(q8, k8, v8, q_descale=qs, k_descale=ks, v_descale=vs,
                                causal=causal)
        back = cudnn_fp8.backward(do8, q8, k8, v8, fwd.out, fwd.lse, q_descale=qs, k_descale=ks,
                                  v_descale=vs, out_descale=fwd.out_descale, dout_descale=dos,
                                  causal=causal)
        grads["cuDNN FP8"] = [host(g) for g in back.dequantized()]
    except Exception as err:  # noqa: BLE001 - a peer that cannot run is reported, not fatal
        grads["cuDNN FP8"] = f"{type(err).__name__}: {err}"
    return grads


def gpu_main(args) -> int:
    scale = args.head_dim ** -0.5
    rng = np.random.default_rng(args.seed)
    print(f"# relative RMSE of (dq, dk, dv) against float64 autograd on the bf16 inputs, GPU "
          f"runs; heads {args.heads}, seqlen {args.seqlen}, head_dim {args.head_dim}, "
          f"seed {args.seed}")
    rows, notes = [], {}
    for causal in (False, True):
        for outliers in (False, True):
            q, k, v, do = inputs(rng, args.heads, args.seqlen, args.head_dim, outliers)
            o_ref, lse_ref = forward(q, k, v, scale, causal)
            refs = backward(q, k, v, o_ref, lse_ref, do, scale, causal, rounding=lambda x: x)
            cells = {}
            for name, got in _gpu_grads(q, k, v, do, causal, args.seed).items():
                if isinstance(got, str):
                    notes[name] = got
                    cells[name] = "-"
                    continue
                errors = [np.linalg.norm(g - r) / np.linalg.norm(r) for g, r in zip(got, refs)]
                cells[name] = " / ".join(f"{e:.4f}" for e in errors)
            label = ("0.1% outliers x10" if outliers else "normal") + (", causal" if causal
                                                                        else "")
            rows.append((label, cells))
    names = list(rows[0][1])
    print("| inputs | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for label, cells in rows:
        print(f"| {label} | " + " | ".join(cells[n] for n in names) + " |")
    for name, reason in notes.items():
        print(f"# {name} did not run: {reason}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
