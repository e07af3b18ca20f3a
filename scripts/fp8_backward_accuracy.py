"""Which GEMMs of an attention backward can take e4m3 operands: the gradients' error, emulated.

    python scripts/fp8_backward_accuracy.py [--seqlen 1024] [--heads 4] [--head-dim 128]
                                            [--causal] [--seed 0]

Needs no GPU (NumPy and ml_dtypes). Inputs are bf16 q, k, v and dO, standard normal, and the
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

The emulation sums in float32 in NumPy's order; an FP8 wgmma sums with less precision (about 14
bits kept, DeepSeek-V3's report for the H800), which only a GPU run measures.
"""

from __future__ import annotations

import argparse

import ml_dtypes
import numpy as np

from ptxattn.quant.hadamard import hadamard_rotation

E4M3 = ml_dtypes.float8_e4m3fn
E4M3_MAX = 448.0
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


ALL = ("dv", "dp", "dqk")
RECIPES = {"bf16": None, "fp8-fwd": (), "dV": ("dv",), "dV,dP": ("dv", "dp"), "dV,dP,dQK": ALL,
           "all+rotation": ALL}


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
    args = parser.parse_args(argv)
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
                dq, dk, dv = backward(q8, k8, v8, bf16(o8), lse8, do, scale, args.causal,
                                      rounding=bf16, e4m3_gemms=gemms)
                got = (dq @ r.T, dk @ r.T, dv)
            errors = [np.linalg.norm(g - r) / np.linalg.norm(r) for g, r in zip(got, refs)]
            cells.append(" / ".join(f"{e:.4f}" for e in errors))
        print(f"| {'0.1% outliers x10' if outliers else 'normal'} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
