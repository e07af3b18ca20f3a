"""Attention computed plainly with CuPy, for tests and as a benchmark peer.

``precision="float32"`` is the ground truth: inputs upcast, every step in FP32.
``precision="input"`` is the same math done naively in the input precision: the scores, the
probabilities and the output are each rounded to the input dtype, as a straightforward
implementation in that dtype would. The error of the latter against the former is the yardstick
a kernel's own error is held to.
"""

from __future__ import annotations

import math

import cupy


def _round_to(x: cupy.ndarray, dtype) -> cupy.ndarray:
    return x.astype(dtype).astype(cupy.float32)


def _heads_major(x, repeat: int = 1) -> cupy.ndarray:
    """(batch, seq, heads, dim) -> (batch, heads * repeat, seq, dim) in FP32, each head repeated
    ``repeat`` times in a row (K/V across the query heads of their group)."""
    x = cupy.ascontiguousarray(x.transpose(0, 2, 1, 3)).astype(cupy.float32)
    return cupy.repeat(x, repeat, axis=1) if repeat > 1 else x


def _operands(q, k, v, softmax_scale, precision: str):
    """What both references start from: the scale, the dtype intermediates are rounded to (None
    in FP32), and q, k, v heads-major in FP32 with K/V repeated per query head."""
    if precision not in ("float32", "input"):
        raise ValueError(f"precision must be 'float32' or 'input', got {precision!r}")
    head_dim = q.shape[3]
    group = q.shape[2] // k.shape[2]
    scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)
    low = q.dtype if precision == "input" else None
    return scale, low, _heads_major(q), _heads_major(k, group), _heads_major(v, group)


def _masked_scores(qf, kf, start: int, stop: int, seqlen_q: int, *, scale: float, low,
                   causal: bool, window: tuple[int, int], softcap: float):
    """The scores of query rows start..stop against every key as the softmax takes them: q k^T
    (rounded to ``low`` unless None) times the scale, softcapped, the keys a row does not see at
    -inf. Also returns the softcap's slope d(capped)/d(scaled) = 1 - tanh^2, which the backward's
    dS passes through (None without a softcap); it is taken before the mask, so it is finite
    where the mask put -inf."""
    seqlen_k = kf.shape[2]
    scores = cupy.matmul(qf[:, :, start:stop], kf.transpose(0, 1, 3, 2))
    if low is not None:
        scores = _round_to(scores, low)
    scores *= scale
    cap_slope = None
    if softcap > 0:
        capped = cupy.tanh(scores / softcap)
        cap_slope = 1 - capped * capped
        scores = softcap * capped
    left, right = window
    right = 0 if causal else right
    key_index = cupy.arange(seqlen_k)[None, :]
    diagonal = cupy.arange(start, stop)[:, None] + (seqlen_k - seqlen_q)
    if right >= 0:
        scores = cupy.where(key_index > diagonal + right, -cupy.inf, scores)
    if left >= 0:
        scores = cupy.where(key_index < diagonal - left, -cupy.inf, scores)
    return scores, cap_slope


def _softmax(scores, sinks):
    """Row-wise softmax of masked scores (batch, heads_q, rows, seqlen_k), each head's sink
    logit (if ``sinks`` is given) joining its rows' denominators as one more key. Returns the
    probabilities, each row's log-sum-exp (keepdims, sinks included) and the sinks' own
    probabilities exp(sink - lse) (None without sinks). A row that sees no key and has no sink
    gets probabilities 0 and LSE -inf."""
    row_max = scores.max(axis=-1, keepdims=True)
    if sinks is not None:
        sink = sinks.astype(cupy.float32)[None, :, None, None]
        row_max = cupy.maximum(row_max, sink)
    safe_max = cupy.where(cupy.isfinite(row_max), row_max, 0.0)
    probs = cupy.exp(scores - safe_max)
    row_sum = probs.sum(axis=-1, keepdims=True)
    sink_probs = None
    if sinks is not None:
        sink_probs = cupy.exp(sink - safe_max)
        row_sum = row_sum + sink_probs
    denominator = cupy.where(row_sum > 0, row_sum, 1.0)
    probs /= denominator
    if sinks is not None:
        sink_probs /= denominator
    return probs, cupy.log(row_sum) + safe_max, sink_probs


def attention(q, k, v, *, causal: bool = False, softmax_scale: float | None = None,
              return_lse: bool = False, precision: str = "float32", query_chunk: int = 1024,
              window: tuple[int, int] = (-1, -1), softcap: float = 0.0, sinks=None):
    """softmax(scale * q k^T) v for (batch, seqlen, heads, head_dim) arrays, v's head_dim its
    own (head_dim_v: the output's).

    Returns float32 output (and float32 LSE of shape (batch, heads, seqlen_q), natural log).
    Causal masking aligns to the bottom-right corner when seqlen_q != seqlen_k; a query row that
    sees no key gets output 0 and LSE -inf (the sink's logit with sinks). ``window`` = (left,
    right) limits query i to keys i + seqlen_k - seqlen_q - left .. + right (-1: unbounded;
    right is 0 when causal); ``softcap`` > 0 turns the scaled scores s into
    softcap * tanh(s / softcap); ``sinks`` (float32, one logit per q head) join every row's
    denominator (and the LSE) without adding to the output.
    """
    batch, seqlen_q, heads_q, _ = q.shape
    scale, low, qf, kf, vf = _operands(q, k, v, softmax_scale, precision)

    out = cupy.empty((batch, heads_q, seqlen_q, v.shape[3]), dtype=cupy.float32)
    lse = cupy.empty((batch, heads_q, seqlen_q), dtype=cupy.float32)
    for start in range(0, seqlen_q, query_chunk):
        stop = min(start + query_chunk, seqlen_q)
        scores, _ = _masked_scores(qf, kf, start, stop, seqlen_q, scale=scale, low=low,
                                   causal=causal, window=window, softcap=softcap)
        probs, row_lse, _ = _softmax(scores, sinks)
        if low is not None:
            probs = _round_to(probs, low)
        out[:, :, start:stop] = cupy.matmul(probs, vf)
        lse[:, :, start:stop] = row_lse[..., 0]
    out = out.transpose(0, 2, 1, 3)
    if low is not None:
        out = _round_to(out, low)
    return (out, lse) if return_lse else out


def attention_backward(dout, q, k, v, *, causal: bool = False,
                       softmax_scale: float | None = None, precision: str = "float32",
                       query_chunk: int = 1024, window: tuple[int, int] = (-1, -1),
                       softcap: float = 0.0, sinks=None):
    """The gradients (dq, dk, dv) of attention() with respect to q, k, v given dout, float32,
    in the inputs' (batch, seqlen, heads, head_dim) layouts (dout's head_dim v's, as the
    output's); dk and dv summed over the q heads of each k/v head's group. ``causal``,
    ``window``, ``softcap`` and ``sinks`` as in attention(); with ``sinks`` a fourth value,
    dsinks: float32 (heads_q,), the gradient of each sink logit summed over the batch and the
    rows, -sum exp(sink - lse) * sum(dout * out).

    ``precision="input"`` rounds every intermediate (scores, probabilities, output, dP, dS, the
    sinks' probabilities and dS among them) to the input dtype, as the naive implementation in
    that dtype would.
    """
    batch, seqlen_q, heads_q, _ = q.shape
    heads_kv = k.shape[2]
    scale, low, qf, kf, vf = _operands(q, k, v, softmax_scale, precision)
    dof = _heads_major(dout)

    def rounded(x):
        return _round_to(x, low) if low is not None else x
    dq = cupy.empty_like(qf)
    dk = cupy.zeros_like(kf)
    dv = cupy.zeros_like(vf)
    dsinks = cupy.zeros(heads_q, dtype=cupy.float32) if sinks is not None else None
    for start in range(0, seqlen_q, query_chunk):
        stop = min(start + query_chunk, seqlen_q)
        scores, cap_slope = _masked_scores(qf, kf, start, stop, seqlen_q, scale=scale, low=low,
                                           causal=causal, window=window, softcap=softcap)
        probs, _, sink_probs = _softmax(scores, sinks)
        probs = rounded(probs)
        out = rounded(cupy.matmul(probs, vf))
        d_out = dof[:, :, start:stop]
        dpsum = (d_out * out).sum(axis=-1, keepdims=True)
        dp = rounded(cupy.matmul(d_out, vf.transpose(0, 1, 3, 2)))
        ds = probs * (dp - dpsum)
        if cap_slope is not None:
            ds *= cap_slope
        ds = rounded(ds)
        if sinks is not None:
            # A sink is a key whose value is 0: its dP is 0, so its dS is -P_sink * dpsum,
            # rounded as every other dS is.
            dsinks -= rounded(rounded(sink_probs) * dpsum).sum(axis=(0, 2, 3))
        dv += cupy.matmul(probs.transpose(0, 1, 3, 2), d_out)
        dk += cupy.matmul(ds.transpose(0, 1, 3, 2), qf[:, :, start:stop])
        dq[:, :, start:stop] = cupy.matmul(ds, kf) * scale
    dk *= scale

    def back(x, heads):
        x = x.reshape(batch, heads, -1, *x.shape[2:]).sum(axis=2) if heads else x
        return rounded(cupy.ascontiguousarray(x.transpose(0, 2, 1, 3)))

    grads = back(dq, None), back(dk, heads_kv), back(dv, heads_kv)
    return grads if sinks is None else (*grads, dsinks)
