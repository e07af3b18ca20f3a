"""Attention throughput: ptxattn's backends beside every peer importable here.

    python -m ptxattn profile [--quick] [--csv FILE] [--json FILE] [--plot FILE.png]
    python -m ptxattn profile --grid targets [--dtype float16] --slow-max-seqlen 0 [--energy]
    python -m ptxattn profile --backward [--quick] [--json FILE] [--plot FILE.png]
    python -m ptxattn profile --backward --fp8 [--quick] [--shapes DxS,...] [--csv F] [--json F]
    python -m ptxattn profile --backward-features [--quick] [--json FILE]
    python -m ptxattn profile --serving [--mla] [--fp8-cache] [--quick] [--repeats N]
    python -m ptxattn profile --head-dims [--quick] [--json FILE]

(in a checkout also ``python scripts/profile.py [options]``). It needs a GPU: without one it
says why (no driver, or CuPy sees no GPU) and exits 2; ``python -m ptxattn doctor`` says more.

TFLOP/s = 4 * batch * heads * seqlen_q * seqlen_k * head_dim / time (halved for causal), time
being the median over repeated CUDA-event-timed samples (each the mean of 10 back-to-back calls)
after warm-up, every runner of a row taking its samples in turn with the others so that all see
the same GPU clock and temperature. Peers run in the same process
on the same GPU: torch SDPA's FlashAttention-2 and cuDNN backends when torch is installed,
FlashAttention-3's forward (bf16, and FP8 e4m3 with per-(batch, head) descales) when the
fa3-fwd wheel imports (module fa3_fwd_interface), and ptxattn's plain CuPy reference. A peer
that does not import is left out with a note on stderr.

--grid targets runs the rows ptxattn is measured against FlashAttention-3 and cuDNN on
(TARGET_SHAPES, a GQA row included) and prints each row's ratio to its best peer.

--backward measures the backward pass, and forward plus backward, instead: TFLOP/s = 2.5 (3.5)
times the forward's FLOPs over the time. Peers: torch SDPA's FlashAttention-2 and cuDNN backward
(torch.autograd.grad of one recorded forward), and FlashAttention-3's backward through the
flash-attn3-jax wheel (flash_mha under jax.vjp, head_dim 128) when it imports. It also reports
the extra memory ptxattn's backward allocates (its workspace).

--backward --fp8 times FP8 e4m3 backward passes instead, 16 heads, batch x seqlen = 32768, at
head_dim 128, 64 and 256 and seqlen 4096, 8192 and (without --quick) 16384, each causal and not,
bfloat16 dout and gradients, in shuffled turns: ptxattn's FP8 backward
(ptxattn.fp8.attention_backward of quantize_qkv(..., "block") inputs, its forward run once,
untimed), ptxattn's bf16 backward (ptxattn.attention_backward), cuDNN's FP8 backward
(cudnn-frontend's sdpa_fp8_backward through ptxattn/tools/cudnn_fp8.py: one scale per tensor,
e4m3 out, dout and gradients, head_dim 128 alone on Hopper; its module docstring says what it
takes and what its time holds) and torch SDPA's cuDNN bf16 backward. TFLOP/s as --backward's;
each row prints ptxattn-fp8's TFLOP/s over ptxattn-bf16's and over cudnn-fp8's. Then, per row,
forward + backward of the torch ops, ptxattn.torch.fp8_attention against ptxattn.torch.attention,
with FP8's time over bf16's. A runner missing here (no torch, no cudnn-frontend or libcudnn, an
op not in this build) is left out with the reason.

--backward-features times the backward of calls with a feature beside the plain call each
stands for, ptxattn alone (torch SDPA has no varlen, window, softcap or sinks argument), bf16 by
default, 16 heads of 128: a varlen batch of 8 x 2048 against the fixed-length 8 x 2048 on the
same memory and a varlen batch of mixed lengths (mixed_lengths: 128 to 8192 summing to about 16k
tokens), each causal and not; a causal window (4096, 0) over seqlen 32768 against the whole
causal sequence, with the window's share of the causal pairs beside its share of the time; a
softcap of 50 and sinks, each against the call without, causal, at seqlens 4096 and 8192 (batch
x seqlen = 16k). Each row prints TFLOP/s = 2.5 x the forward's FLOPs over the (query, key) pairs
the call computes (visible_pairs; fixed-length rows without a window as above), the
milliseconds, and each call's time over the plain call's.

--serving times the serving calls, each row's calls in shuffled turns as above, beside a device
copy's bandwidth measured in the same run: one-token decode in GB/s of the K/V cache read (and
its fraction of the copy's read + write bandwidth), contiguous and paged, beside torch SDPA and
FlashAttention-3's flash_attn_with_kvcache; varlen, chunked and sliding-window prefill in TFLOP/s;
MLA decode (ptxattn.attention_mla_decode: q and one cache head of 576 = 512 latent, which are
the values, + 64 rotary) at 128 query heads and at 16 (a tensor-parallel slice), batch 64 and 128
over 4096 and 16384 keys, one new token, and 2 and 4 new tokens at 128 heads over 4096 keys
(compute-bound), each with a 16-bit and an e4m3 cache (ptxattn.fp8.E4M3Array, one descale),
contiguous and in pages of 64 (a shuffled block table), in GB/s of the cache's bytes (B L 576 x
its item size) and TFLOP/s (2 B Sq H L (576 + 512)), beside FlashAttention-3's MLA path
(flash_attn_with_kvcache with qv=) where the installed build has it; and e4m3 K/V caches
against 16-bit ones at batch 64 x 8192 keys, 32/8 heads of 128, ptxattn's and
FlashAttention-3's (whose e4m3 takes e4m3 queries too). The e4m3 rows also print the tokens/s
of e4m3 over 16-bit. A small FlashAttention-3 MLA call of each kind (contiguous, paged, e4m3)
runs first, and a kind that build lacks is said once and left out of the rows (fa3-fwd 0.0.3
has bf16 MLA on contiguous caches alone). --mla and --fp8-cache run those rows alone; --quick
takes 5 runs and the batch-64 MLA rows alone.

--head-dims times the forward and the backward at head dims beyond 64, 128 and 256 (80, 96,
192, and 192 with 128-wide values; --quick at seqlen 4096, otherwise 2048 and 8192 with more
dims), batch x seqlen = 16k and heads x head_dim about 2048, beside FlashAttention-3's forward
and torch SDPA's cuDNN and FlashAttention-2, forward and backward, where each takes the dims.
FLOPs count the call's own head dims (2 B H Sq Sk (head_dim + head_dim_v), halved for causal;
2.5 times that backward), so a head dim run padded to a compiled one shows its cost.

--energy adds, for the forward rows, each compared runner's energy per call (ptxattn-hopper,
ptxattn-fp8-head and their peers): after the timing, each runs alone for --energy-window seconds
in shuffled turns while NVML (the driver's libnvidia-ml) reads the board's energy counter and SM
clock; it prints TFLOP per joule, mean watts and MHz. On a power-capped GPU a kernel that does
less work per joule runs at a lower clock, so this tells a row bound by power from one bound by
cycles. Where NVML or the counter is missing it says so and times only.

--plot draws the measured rows (TFLOP/s against seqlen, a line per backend or peer, a panel per
head_dim and mask) into an image; it needs matplotlib (pip install 'ptxattn[plot]').
"""

from __future__ import annotations

import argparse
import collections
import csv
import functools
import json
import os
import sys

from .timing import Nvml, attention_flops, energy_per_call_interleaved, time_ms_interleaved


PROG = "ptxattn profile"  # the command's name in its messages

# Peers that take torch tensors (views of the same CuPy data through DLPack).
TORCH_PEERS = ("torch-", "fa3")


def nvrtc_text() -> str:
    """The NVRTC that compiles the kernels: the same source compiled by another NVRTC runs up to
    about 8% faster or slower (NVRTC 13.0 against 13.5, measured on an H100 SXM on 2026-11-26:
    docs/design/measurement.md#nvrtc-versions)."""
    from ..runtime import nvrtc_version
    return "%d.%d" % nvrtc_version()


def device_props() -> dict:
    import cupy
    return cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)


def device_line(props: dict, arch: str) -> str:
    """The GPU and the NVRTC, for a results header."""
    return f"{props['name'].decode()} ({arch}), NVRTC {nvrtc_text()}"


def configs(quick: bool) -> list[dict]:
    """The standard sweep: batch*seqlen = 16384 and heads*head_dim = 2048, plus one fixed shape."""
    seqlens = [2048, 8192] if quick else [512, 1024, 2048, 4096, 8192, 16384]
    dims = [128] if quick else [64, 128, 256]
    rows = [dict(batch=4, seqlen=2048, heads=32, head_dim=128, causal=causal)
            for causal in (False, True)]
    for head_dim in dims:
        for seqlen in seqlens:
            for causal in (False, True):
                rows.append(dict(batch=16384 // seqlen, seqlen=seqlen, heads=2048 // head_dim,
                                 head_dim=head_dim, causal=causal))
    return rows


# The fields of a result row that describe its shape; the others are runners' TFLOP/s, and with
# --energy a runner's "<name> TFLOP/J", "<name> W" and "<name> MHz" (ENERGY_FIELDS).
SHAPE_FIELDS = ("batch", "seqlen", "heads", "head_dim", "causal", "heads_kv")
ENERGY_FIELDS = (" TFLOP/J", " W", " MHz")


def plot_rows(rows: list[dict], path: str, title: str) -> None:
    """Draws result rows (SHAPE_FIELDS plus runner name -> TFLOP/s or None, as --csv and
    --json write them) into the image ``path``: TFLOP/s against seqlen, a line per runner, a
    panel per (head_dim, causal). Only the rows of the sweep are drawn: those whose batch *
    seqlen and heads * head_dim are the ones most rows have (not the fixed shape beside them)."""
    import matplotlib
    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    def size(row):
        return row["batch"] * row["seqlen"], row["heads"] * row["head_dim"]

    tokens, width = collections.Counter(size(row) for row in rows).most_common(1)[0][0]
    swept = [row for row in rows if size(row) == (tokens, width)]
    head_dims = sorted({row["head_dim"] for row in swept})
    masks = sorted({row["causal"] for row in swept})
    names = list(dict.fromkeys(name for row in swept for name in row
                               if name not in SHAPE_FIELDS and not name.endswith(ENERGY_FIELDS)))
    # A runner keeps its colour and line in every panel, also where others are missing.
    styles = {name: dict(color=f"C{i % 10}", linestyle=("-", "--", ":")[i // 10 % 3])
              for i, name in enumerate(names)}
    figure, axes = plt.subplots(len(head_dims), len(masks), squeeze=False, layout="constrained",
                                figsize=(6 * len(masks), 1.5 + 3.5 * len(head_dims)))
    for i, head_dim in enumerate(head_dims):
        for j, causal in enumerate(masks):
            ax = axes[i][j]
            group = [row for row in swept if (row["head_dim"], row["causal"]) == (head_dim, causal)]
            for name in names:
                points = sorted((row["seqlen"], row[name]) for row in group
                                if row.get(name) is not None)
                if points:
                    ax.plot(*zip(*points), marker="o", label=name, **styles[name])
            seqlens = sorted({row["seqlen"] for row in group})
            ax.set_xscale("log", base=2)
            ax.set_xticks(seqlens, [str(s) for s in seqlens])
            ax.set_title(f"head_dim {head_dim}, {'causal' if causal else 'non-causal'}")
            ax.set_xlabel("seqlen")
            ax.set_ylabel("TFLOP/s")
            ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3)
    handles = {}  # one legend entry per runner, whichever panels it appears in
    for ax in axes.flat:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, handle)
    labels = list(handles)
    figure.legend([handles[label] for label in labels], labels, loc="outside lower center",
                  ncol=min(4, max(1, len(labels))))
    figure.suptitle(f"{title}\nbatch * seqlen = {tokens}, heads * head_dim = {width}")
    figure.savefig(path, dpi=120)
    plt.close(figure)


# The forward rows ptxattn is measured against FlashAttention-3 and cuDNN on (issue 17's grid):
# (batch, seqlen, heads, head_dim, kv heads), each causal and not.
TARGET_SHAPES = [(4, 2048, 32, 128, 32), (2, 8192, 16, 128, 16), (1, 16384, 16, 128, 16),
                 (32, 512, 16, 128, 16), (8, 2048, 32, 64, 32), (1, 16384, 32, 64, 32),
                 (8, 2048, 8, 256, 8), (1, 16384, 8, 256, 8), (4, 4096, 32, 128, 8)]
# Who each kind of ptxattn row is compared with: 16-bit against every 16-bit peer, FP8 with
# per-head scales against FlashAttention-3's FP8 on the same quantized data.
RATIOS = {"ptxattn-hopper": ("torch-sdpa-flash", "torch-sdpa-cudnn", "fa3"),
          "ptxattn-fp8-head": ("fa3-fp8",)}
# The runners --energy measures: those RATIOS compares.
ENERGY_RUNNERS = tuple(dict.fromkeys(n for ours, peers in RATIOS.items() for n in (ours, *peers)))


def target_configs() -> list[dict]:
    return [dict(batch=b, seqlen=s, heads=h, head_dim=d, causal=causal,
                 **({"heads_kv": kv} if kv != h else {}))
            for b, s, h, d, kv in TARGET_SHAPES for causal in (False, True)]


def row_label(row: dict) -> str:
    """A result row's shape as BxSxH[/KV]xD, with " causal" where it is."""
    gqa = f"/{row['heads_kv']}" if "heads_kv" in row else ""
    return (f"{row['batch']}x{row['seqlen']}x{row['heads']}{gqa}x{row['head_dim']}"
            f"{' causal' if row['causal'] else ''}")


def ratio_lines(rows: list[dict]) -> list[str]:
    """Per row, each ptxattn runner of RATIOS over the best of its peers that ran there."""
    lines = []
    for row in rows:
        cells = []
        for ours, peers in RATIOS.items():
            best = max(((row[p], p) for p in peers if row.get(p) is not None), default=None)
            if row.get(ours) is None or best is None:
                continue
            cells.append(f"{ours} {row[ours]:.0f} / {best[1]} {best[0]:.0f} = "
                         f"{row[ours] / best[0]:.3f}x")
        lines.append(f"{row_label(row)}: " + ", ".join(cells))
    return lines


def energy_lines(rows: list[dict]) -> list[str]:
    """Per row, each measured runner's TFLOP per joule, watts and SM MHz (the --energy fields)."""
    lines = []
    for row in rows:
        cells = [f"{n} {row[n + ' TFLOP/J']:.3f} TFLOP/J {row[n + ' W']:.0f} W "
                 f"{row[n + ' MHz']:.0f} MHz" for n in ENERGY_RUNNERS if n + " TFLOP/J" in row]
        lines.append(f"{row_label(row)}: " + ", ".join(cells))
    return lines


def backward_plot_rows(results: list[dict]) -> list[dict]:
    """The --backward results as plot_rows takes them: the shape and each runner's backward
    TFLOP/s."""
    return [dict({f: row[f] for f in SHAPE_FIELDS if f in row}, **row["backward"])
            for row in results]


def flops(cfg: dict) -> float:
    return attention_flops(cfg["batch"], cfg["heads"], cfg["seqlen"], cfg["seqlen"],
                           cfg["head_dim"], cfg["causal"])


def ptxattn_runners(arch: str) -> dict:
    """Each 16-bit backend's fixed-length forward that runs on ``arch`` (its dispatch route)."""
    import ptxattn
    from ptxattn import dispatch

    runners = {}
    for route in dispatch.TABLE:
        if (route.call == "forward" and "bfloat16" in route.formats and arch in route.archs
                and f"ptxattn-{route.backend}" not in runners):
            runners[f"ptxattn-{route.backend}"] = (
                route.head_dims, None,
                lambda q, k, v, causal, name=route.backend: ptxattn.attention(
                    q, k, v, causal=causal, backend=name))
    return runners


def _quantized_once(quantize, attend):
    """A runner that quantizes each new input set once (untimed after warm-up), then attends."""
    quantized = {}

    def run(q, k, v, causal):
        key = tuple(x.data_ptr() if hasattr(x, "data_ptr") else x.data.ptr for x in (q, k, v))
        if key not in quantized:
            quantized.clear()
            quantized[key] = quantize(q, k, v)
        return attend(quantized[key], causal)
    return run


def fp8_runners(arch: str) -> dict:
    """FP8 e4m3 attention, bf16 output: ptxattn-fp8 with per-block q/k scales (per 128 rows;
    key tiles must then divide 128), ptxattn-fp8-head with per-(batch, head) scales (the
    kernel's own tile sizes)."""
    from ptxattn import fp8

    if arch not in fp8.ARCHS:
        return {}
    return {name: (fp8.HEAD_DIMS, None, _quantized_once(
        lambda q, k, v, granularity=granularity: fp8.quantize_qkv(q, k, v,
                                                                  granularity=granularity),
        lambda qkv, causal: fp8.attention(*qkv[:3], **qkv[3], causal=causal)))
        for name, granularity in (("ptxattn-fp8", "block"), ("ptxattn-fp8-head", "head"))}


def blockscaled_runners(arch: str, emulated_max_seqlen: int) -> tuple[dict, list[str]]:
    """The block-scaled (MXFP8 / NVFP4) kernels, quantizing each input set once, untimed. The
    emulation build (sm_90a) is slow and only shows it runs, so it gets the short shapes only."""
    import warnings

    from ptxattn import blockscaled
    from ptxattn.launchers import blockscaled as blockscaled_launcher

    try:
        build = blockscaled_launcher.build_for_arch(arch)
    except RuntimeError:
        return {}, []
    warnings.filterwarnings("ignore", "ptxattn.blockscaled_attention", RuntimeWarning)
    suffix = "-emulated" if build == "emulated" else ""

    max_seqlen = emulated_max_seqlen if suffix else None
    runners = {f"ptxattn-{fmt}{suffix}": (blockscaled_launcher.HEAD_DIMS, max_seqlen,
                                          _quantized_once(
        lambda q, k, v, fmt=fmt: blockscaled.quantize_qkv(q, k, v, fmt),
        lambda operands, causal: blockscaled.blockscaled_attention(**operands, causal=causal)))
        for fmt in blockscaled_launcher.FORMATS}
    notes = [f"ptxattn-*{suffix}: the sm_90a emulation build of the sm_120a block-scaled kernel "
             "(correct, not fast; not a speed result)"] if suffix else []
    return runners, notes


def torch_runners() -> dict:
    try:
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from torch.nn.functional import scaled_dot_product_attention
    except ImportError:
        return {}

    def make(backend):
        def run(q, k, v, causal):
            # SDPA wants (batch, heads, seqlen, dim); these are views of our (b, s, h, d) data.
            with sdpa_kernel(backend):
                return scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                    v.transpose(1, 2), is_causal=causal,
                                                    enable_gqa=k.shape[2] != q.shape[2])
        return run

    return {"torch-sdpa-flash": ((64, 128, 256), None, make(SDPBackend.FLASH_ATTENTION)),
            "torch-sdpa-cudnn": ((64, 128, 256), None, make(SDPBackend.CUDNN_ATTENTION))}


def fa3_runners() -> dict:
    """FlashAttention-3's forward from the fa3-fwd wheel: bf16, and FP8 e4m3 (q, k, v quantized
    once per input set with per-(batch, head) descales, bf16 output, as ptxattn-fp8-head; with
    GQA, FA3 takes one q descale per kv head, so q's is the largest of its group's heads)."""
    try:
        import fa3_fwd_config
        import torch
        # fa3_fwd_interface imports the build configuration under FlashAttention's own name.
        sys.modules.setdefault("flash_attn_config", fa3_fwd_config)
        from fa3_fwd_interface import flash_attn_func
    except (ImportError, OSError):
        return {}

    def bf16(q, k, v, causal):
        return flash_attn_func(q, k, v, causal=causal)

    def quantize(q, k, v):
        def per_head(x, group=1):
            amax = x.abs().amax(dim=(1, 3)).float()
            scale = (amax.unflatten(1, (-1, group)).amax(dim=2) / 448.0).clamp_min(1e-12)
            per_row_head = scale.repeat_interleave(group, dim=1)
            x8 = (x.float() / per_row_head[:, None, :, None]).to(torch.float8_e4m3fn)
            return x8, scale.contiguous()
        q8, qd = per_head(q, q.shape[2] // k.shape[2])
        (k8, kd), (v8, vd) = (per_head(x) for x in (k, v))
        return q8, k8, v8, qd, kd, vd

    def fp8(operands, causal):
        q8, k8, v8, qd, kd, vd = operands
        return flash_attn_func(q8, k8, v8, causal=causal, q_descale=qd, k_descale=kd,
                               v_descale=vd)

    return {"fa3": ((64, 128, 256), None, bf16),
            "fa3-fp8": ((64, 128, 256), None, _quantized_once(quantize, fp8))}


def parse_shapes(shapes: str) -> list[tuple[int, int]]:
    """--shapes "DxS,DxS,...": (head_dim, seqlen) pairs."""
    return [tuple(int(n) for n in shape.split("x")) for shape in shapes.split(",")]


def backward_configs(quick: bool, shapes: str | None = None) -> list[dict]:
    """The backward sweep: batch*seqlen = 16384, heads*head_dim = 2048; ``shapes`` ("DxS,...")
    picks (head_dim, seqlen) pairs instead."""
    if shapes:
        shapes = parse_shapes(shapes)
    else:
        shapes = ([(128, 2048), (128, 8192), (64, 2048), (256, 2048)] if quick else
                  [(128, 2048), (128, 8192), (128, 16384), (64, 2048), (64, 16384),
                   (256, 16384)])
    return [dict(batch=16384 // seqlen, seqlen=seqlen, heads=2048 // head_dim,
                 head_dim=head_dim, causal=causal)
            for head_dim, seqlen in shapes for causal in (False, True)]


def torch_backward_runners(torch, q, k, v, dout, causal: bool,
                           names=("torch-sdpa-flash", "torch-sdpa-cudnn")) -> dict:
    """name -> (backward, forward + backward) callables for torch SDPA's FA2 and cuDNN (those
    of ``names``)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    tq, tk, tv = (torch.from_dlpack(x).transpose(1, 2).detach().requires_grad_()
                  for x in (q, k, v))
    tdo = torch.from_dlpack(dout).transpose(1, 2)
    runners = {}
    backends = {"torch-sdpa-flash": SDPBackend.FLASH_ATTENTION,
                "torch-sdpa-cudnn": SDPBackend.CUDNN_ATTENTION}
    for name, backend in ((name, backends[name]) for name in names):
        def forward(backend=backend):
            with sdpa_kernel(backend):
                return sdpa(tq, tk, tv, is_causal=causal)
        try:
            recorded = forward()
        except RuntimeError as err:
            print(f"\n{name}: {err}", file=sys.stderr)
            continue
        runners[name] = (
            lambda o=recorded: torch.autograd.grad(o, (tq, tk, tv), tdo, retain_graph=True),
            lambda forward=forward: torch.autograd.grad(forward(), (tq, tk, tv), tdo))
    return runners


def fa3_jax_backward_runner(shape, causal: bool):
    """(backward, forward + backward) of FlashAttention-3 through flash-attn3-jax, on its own
    random inputs of ``shape``; None when it does not import or run. JAX runs on its own stream,
    so each call waits for its result (the timing then includes that host round trip)."""
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    try:
        import jax
        import jax.numpy as jnp
        from flash_attn3_jax import flash_mha
    except Exception as err:  # noqa: BLE001 - any import failure leaves the peer out
        return None, f"flash_attn3_jax does not import: {type(err).__name__}: {err}"
    try:
        keys = jax.random.split(jax.random.PRNGKey(0), 4)
        q, k, v, dout = (jax.random.normal(key, shape, dtype=jnp.bfloat16) for key in keys)

        def attend(q, k, v):
            return flash_mha(q, k, v, is_causal=causal)

        _, vjp = jax.vjp(attend, q, k, v)
        backward = jax.jit(lambda fn, d: fn(d))
        both = jax.jit(lambda q, k, v, d: jax.vjp(attend, q, k, v)[1](d))
        backward(vjp, dout)[0].block_until_ready()
        both(q, k, v, dout)[0].block_until_ready()
    except Exception as err:  # noqa: BLE001
        return None, f"flash_attn3_jax failed on {shape}: {type(err).__name__}: {err}"
    return (lambda: backward(vjp, dout)[0].block_until_ready(),
            lambda: both(q, k, v, dout)[0].block_until_ready()), None


def backward_main(args) -> int:
    import ptxattn
    from ptxattn import dispatch, problem as problem_module
    from ptxattn.launchers import backward_prepost, hopper_backward
    from ptxattn.runtime import device_arch

    arch = device_arch()
    repeats = args.repeats or (5 if args.quick else 10)
    try:
        import torch
    except ImportError:
        torch = None
        print(f"{PROG}: torch is not importable, so no SDPA peers in this run",
              file=sys.stderr)
    props = device_props()
    print(f"# {device_line(props, arch)}, dtype {args.dtype}, backward, median of {repeats} runs")
    # backend -> the head dims its backward takes here
    backends: dict[str, set] = {}
    for r in dispatch.TABLE:
        if "backward" in r.features and "bfloat16" in r.formats and arch in r.archs:
            backends.setdefault(r.backend, set()).update(r.head_dims)
    results, notes = [], set()
    for cfg, shape, causal, (q, k, v, dout) in backward_inputs(
            backward_configs(args.quick, args.shapes), args.dtype):
        out, lse = ptxattn.attention(q, k, v, causal=causal, return_lse=True)
        calls = {}
        for backend in [b for b, dims in backends.items() if cfg["head_dim"] in dims]:
            for deterministic in (False, True):
                name = f"ptxattn-{backend}{'-det' if deterministic else ''}"
                calls[name] = (
                    lambda b=backend, d=deterministic: ptxattn.attention_backward(
                        dout, q, k, v, out, lse, causal=causal, deterministic=d, backend=b),
                    lambda b=backend, d=deterministic: ptxattn.attention_backward(
                        dout, q, k, v, *ptxattn.attention(q, k, v, causal=causal,
                                                          return_lse=True),
                        causal=causal, deterministic=d, backend=b))
        if torch is not None:
            calls.update(torch_backward_runners(torch, q, k, v, dout, causal))
        if cfg["head_dim"] == 128:
            fa3, note = fa3_jax_backward_runner(shape, causal)
            if fa3:
                calls["fa3-jax"] = fa3
            else:
                notes.add(note.split(" on ")[0] if note.startswith("flash_attn3_jax failed")
                          else note)
        for name, (bwd, _) in calls.items():
            bwd()
        bwd_ms = time_ms_interleaved({n: c[0] for n, c in calls.items()}, warmup=2,
                                     repeats=repeats)
        both_ms = time_ms_interleaved({n: c[1] for n, c in calls.items()}, warmup=2,
                                      repeats=repeats)
        fwd_flops = flops(cfg)
        p = problem_module.AttentionProblem.from_backward(dout, q, k, v, out, lse, causal=causal)
        # the Hopper kernel's workspace (its row values padded to whole query tiles)
        block_m = hopper_backward.variant(p.format, p.head_dim, causal).block_m
        accum, padded_rows, _ = backward_prepost.Workspace.sizes(p, block_m, deterministic=False,
                                                                 head_dim=p.head_dim)
        workspace = (accum + 2 * padded_rows) * 4
        results.append(dict(cfg, workspace_mib=workspace / 2 ** 20,
                            backward={n: 2.5 * fwd_flops / ms / 1e9 for n, ms in bwd_ms.items()},
                            forward_backward={n: 3.5 * fwd_flops / ms / 1e9
                                              for n, ms in both_ms.items()}))
    print("\r" + " " * 80 + "\r", end="", file=sys.stderr)
    names = list(dict.fromkeys(n for r in results for n in r["backward"]))
    widths = [max(len(n), 7) for n in names]
    for title, key in (("backward TFLOP/s", "backward"),
                       ("forward + backward TFLOP/s", "forward_backward")):
        print(title)
        print(f"{'batch':>5} {'seqlen':>6} {'heads':>5} {'dim':>4} {'causal':>6} "
              + " ".join(f"{n:>{w}}" for n, w in zip(names, widths)) + "  workspace MiB")
        for row in results:
            cells = " ".join(f"{row[key][n]:{w}.1f}" if n in row[key] else f"{'-':>{w}}"
                             for n, w in zip(names, widths))
            print(f"{row['batch']:5d} {row['seqlen']:6d} {row['heads']:5d} "
                  f"{row['head_dim']:4d} {str(row['causal']):>6} {cells}  "
                  f"{row['workspace_mib']:13.1f}")
    for note in sorted(notes):
        print(f"# {note}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": props["name"].decode(), "arch": arch, "nvrtc": nvrtc_text(),
                       "dtype": args.dtype, "unit": "TFLOP/s", "results": results}, f, indent=1)
    if args.plot:
        plot_rows(backward_plot_rows(results),
                  args.plot, f"{props['name'].decode()} ({arch}), {args.dtype}, backward")
    return 0


# --backward --fp8: 16 heads, batch x seqlen = 32k tokens, each (head_dim, seqlen) causal and not
FP8_BACKWARD_HEADS = 16
FP8_BACKWARD_TOKENS = 32768
FP8_BACKWARD_DIMS = (128, 64, 256)
# The runners of an FP8 backward row, in the order the table prints them; each ratio line is
# ptxattn-fp8's TFLOP/s over another's.
FP8_BACKWARD_RUNNERS = ("ptxattn-fp8", "ptxattn-bf16", "cudnn-fp8", "torch-sdpa-cudnn")
FP8_BACKWARD_RATIOS = ("ptxattn-bf16", "cudnn-fp8")


def fp8_backward_configs(quick: bool, shapes: str | None = None) -> list[dict]:
    """--backward --fp8 rows: 16 heads, batch x seqlen = 32768, head_dim 128, 64 and 256 at
    seqlen 4096, 8192 and (without --quick) 16384, each causal and not; ``shapes`` ("DxS,...")
    picks (head_dim, seqlen) pairs instead."""
    seqlens = (4096, 8192) if quick else (4096, 8192, 16384)
    pairs = (parse_shapes(shapes) if shapes else
             [(head_dim, seqlen) for head_dim in FP8_BACKWARD_DIMS for seqlen in seqlens])
    return [dict(batch=max(1, FP8_BACKWARD_TOKENS // seqlen), seqlen=seqlen,
                 heads=FP8_BACKWARD_HEADS, head_dim=head_dim, causal=causal)
            for head_dim, seqlen in pairs for causal in (False, True)]


def fp8_table_lines(results: list[dict]) -> list[str]:
    """The --backward --fp8 table: a row's shape and each runner's backward TFLOP/s ("-" where
    it did not run)."""
    widths = [max(len(n), 7) for n in FP8_BACKWARD_RUNNERS]
    lines = [f"{'batch':>5} {'seqlen':>6} {'heads':>5} {'dim':>4} {'causal':>6} "
             + " ".join(f"{n:>{w}}" for n, w in zip(FP8_BACKWARD_RUNNERS, widths))]
    for row in results:
        cells = " ".join(f"{row['backward'][n]:{w}.1f}" if n in row["backward"]
                         else f"{'-':>{w}}" for n, w in zip(FP8_BACKWARD_RUNNERS, widths))
        lines.append(f"{row['batch']:5d} {row['seqlen']:6d} {row['heads']:5d} "
                     f"{row['head_dim']:4d} {str(row['causal']):>6} {cells}")
    return lines


def fp8_ratio_line(row: dict) -> str:
    """A row's ptxattn-fp8 TFLOP/s over ptxattn-bf16's and over cudnn-fp8's, where both ran."""
    tflops = row["backward"]
    cells = [f"ptxattn-fp8 / {peer} {tflops['ptxattn-fp8'] / tflops[peer]:.3f}x"
             for peer in FP8_BACKWARD_RATIOS if "ptxattn-fp8" in tflops and peer in tflops]
    shown = ", ".join(cells) or "no ratio (ptxattn-fp8 or its peers did not run)"
    return f"{row_label(row)}: {shown}"


def torch_ops_line(row: dict) -> str:
    """A row's forward + backward of ptxattn.torch.fp8_attention and ptxattn.torch.attention:
    milliseconds and TFLOP/s (3.5 x the forward's FLOPs), then FP8's time over bf16's."""
    ms = row.get("torch_ops_ms", {})
    work = 3.5 * flops(row)
    cells = ", ".join(f"{name} {t:.3f} ms ({work / t / 1e9:.1f} TFLOP/s)"
                      for name, t in ms.items())
    ratio = (f"; fp8_attention / attention time {ms['fp8_attention'] / ms['attention']:.3f}"
             if {"fp8_attention", "attention"} <= ms.keys() else "")
    return f"{row_label(row)}: {cells or 'no torch op ran'}{ratio}"


def ptxattn_fp8_backward_runner(q, k, v, dout, causal: bool):
    """ptxattn's FP8 backward (``ptxattn.fp8.attention_backward``) of q, k, v quantized by
    ``quantize_qkv(..., "block")``, its forward run once, untimed: (call, None), or (None, why
    not)."""
    from ptxattn import fp8

    if not hasattr(fp8, "attention_backward"):
        return None, "ptxattn-fp8: ptxattn.fp8.attention_backward is not in this build"
    try:
        q8, k8, v8, descales = fp8.quantize_qkv(q, k, v, "block")
        out, lse = fp8.attention(q8, k8, v8, **descales, causal=causal, return_lse=True)
    except Exception as err:  # noqa: BLE001 - an arch or shape FP8 lacks, reported
        return None, f"ptxattn-fp8: the forward failed: {type(err).__name__}: {err}"
    return functools.partial(fp8.attention_backward, dout, q8, k8, v8, out, lse, **descales,
                             causal=causal), None


def cudnn_fp8_backward_runner(torch, q, k, v, dout, causal: bool):
    """cuDNN's FP8 backward (ptxattn/tools/cudnn_fp8.py) of q, k, v and dout quantized per
    tensor by ``ptxattn.fp8.quantize`` (cuDNN takes one scale a tensor), its forward and its
    scales' calibration run once, untimed: (call, None), or (None, why not)."""
    from ptxattn import fp8

    from . import cudnn_fp8

    def per_tensor(x):
        x8, descale = fp8.quantize(x, "tensor")
        return torch.from_dlpack(x8.bytes).view(torch.float8_e4m3fn), torch.from_dlpack(descale)

    try:
        cudnn_fp8.load()  # what is missing is said before anything is quantized
        (q8, q_descale), (k8, k_descale), (v8, v_descale), (dout8, dout_descale) = (
            per_tensor(x) for x in (q, k, v, dout))
        descales = dict(q_descale=q_descale, k_descale=k_descale, v_descale=v_descale)
        forward = cudnn_fp8.forward(q8, k8, v8, **descales, causal=causal)
        call = functools.partial(cudnn_fp8.backward, dout8, q8, k8, v8, forward.out, forward.lse,
                                 **descales, out_descale=forward.out_descale,
                                 dout_descale=dout_descale, causal=causal)
        scales = call().scales
    except cudnn_fp8.CudnnUnavailable as err:  # no library, or a graph cuDNN declines
        return None, f"cudnn-fp8: {' '.join(str(err).split())}"
    except Exception as err:  # noqa: BLE001 - a peer's failure is reported, not fatal
        return None, f"cudnn-fp8 failed: {type(err).__name__}: {' '.join(str(err).split())}"
    return functools.partial(call, scales=scales), None


def torch_ops_runners(torch, q, k, v, dout, causal: bool):
    """Forward + backward (torch.autograd.grad of a fresh forward) of ptxattn.torch's
    fp8_attention and attention on views of q, k, v: (name -> call, notes on what is missing)."""
    import ptxattn.torch as ops

    tq, tk, tv = (torch.from_dlpack(x).detach().requires_grad_() for x in (q, k, v))
    tdo = torch.from_dlpack(dout)

    def step(attend):
        return lambda: torch.autograd.grad(attend(tq, tk, tv, causal=causal), (tq, tk, tv), tdo)

    calls = {"attention": step(ops.attention)}
    if not hasattr(ops, "fp8_attention"):
        return calls, ["torch ops: ptxattn.torch.fp8_attention is not in this build, so no "
                       "fp8_attention time"]
    calls["fp8_attention"] = step(ops.fp8_attention)
    return calls, []


def calls_that_run(calls: dict, shape) -> dict:
    """The calls of ``calls`` that run (each called once: compiles and warms); one that fails
    (a shape a runner lacks) is reported on stderr and left out."""
    kept = {}
    for name, call in calls.items():
        error = first_error(call)
        if error is None:
            kept[name] = call
        else:
            print(f"\n{name} failed on {shape}: {error}", file=sys.stderr)
    return kept


def backward_inputs(rows: list[dict], dtype: str):
    """Each backward row's (cfg, shape, causal, (q, k, v, dout)): standard normal inputs of
    ``dtype`` from the row's own seed, its progress shown on stderr."""
    import cupy

    for index, cfg in enumerate(rows, 1):
        shape = (cfg["batch"], cfg["seqlen"], cfg["heads"], cfg["head_dim"])
        causal = cfg["causal"]
        print(f"\r[{index}/{len(rows)}] {shape} causal={causal}", end="", file=sys.stderr,
              flush=True)
        rng = cupy.random.default_rng(index)
        yield cfg, shape, causal, tuple(
            rng.standard_normal(shape, dtype=cupy.float32).astype(dtype) for _ in range(4))


def write_results(args, rows: list[dict], results: list, header: dict) -> None:
    """``--csv``: ``rows`` (flat dicts, one a line, columns in first-seen order); ``--json``:
    ``header`` with ``results`` under "results"."""
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(dict.fromkeys(
                name for row in rows for name in row)))
            writer.writeheader()
            writer.writerows(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**header, "results": results}, f, indent=1)


def backward_fp8_main(args) -> int:
    """FP8 backward rows (fp8_backward_configs): ptxattn's FP8 backward beside its bf16 one,
    cuDNN's FP8 backward and torch SDPA's cuDNN bf16 backward, interleaved; then forward +
    backward of ptxattn.torch.fp8_attention against ptxattn.torch.attention."""
    import ptxattn
    from ptxattn.runtime import device_arch

    arch = device_arch()
    repeats = args.repeats or (5 if args.quick else 10)
    try:
        import torch
    except ImportError:
        torch = None
        print(f"{PROG}: torch is not importable, so no cuDNN peers and no torch-op rows in "
              "this run", file=sys.stderr)
    props = device_props()
    print(f"# {device_line(props, arch)}, backward FP8 e4m3 (bfloat16 dout and gradients), "
          f"median of {repeats} runs")
    print("# TFLOP/s = 2.5 x 4 x batch x heads x seqlen^2 x head_dim / time, halved for causal; "
          "ptxattn-fp8: q and k per 128 rows, v per head (quantize_qkv 'block'); cudnn-fp8: "
          "one scale per tensor, e4m3 out, dout and gradients (ptxattn/tools/cudnn_fp8.py)")
    if torch is not None:
        from . import cudnn_fp8
        try:
            print(f"# {cudnn_fp8.library_line()}")
        except cudnn_fp8.CudnnUnavailable:
            pass  # each row says why cudnn-fp8 did not run
    results, notes = [], []
    for cfg, shape, causal, (q, k, v, dout) in backward_inputs(
            fp8_backward_configs(args.quick, args.shapes), "bfloat16"):
        out, lse = ptxattn.attention(q, k, v, causal=causal, return_lse=True)
        candidates = {"ptxattn-bf16": (functools.partial(
            ptxattn.attention_backward, dout, q, k, v, out, lse, causal=causal), None)}
        candidates["ptxattn-fp8"] = ptxattn_fp8_backward_runner(q, k, v, dout, causal)
        ops = {}
        if torch is not None:
            candidates["cudnn-fp8"] = cudnn_fp8_backward_runner(torch, q, k, v, dout, causal)
            sdpa = torch_backward_runners(torch, q, k, v, dout, causal,
                                          names=("torch-sdpa-cudnn",)).get("torch-sdpa-cudnn")
            candidates["torch-sdpa-cudnn"] = ((sdpa[0], None) if sdpa else
                                              (None, "torch-sdpa-cudnn did not run"))
            ops, missing = torch_ops_runners(torch, q, k, v, dout, causal)
            notes += [note for note in missing if note not in notes]
        calls = {}
        for name in FP8_BACKWARD_RUNNERS:
            call, why_not = candidates.get(name, (None, None))
            if call is not None:
                calls[name] = call
            elif why_not and why_not not in notes:
                notes.append(why_not)
        calls, ops = calls_that_run(calls, shape), calls_that_run(ops, shape)
        work = 2.5 * flops(cfg)
        results.append(dict(cfg, backward={
            name: work / ms / 1e9 for name, ms in
            time_ms_interleaved(calls, warmup=2, repeats=repeats).items()},
            torch_ops_ms=time_ms_interleaved(ops, warmup=2, repeats=repeats)))
        del q, k, v, dout, out, lse, candidates, calls, ops
    print("\r" + " " * 80 + "\r", end="", file=sys.stderr)
    print("backward TFLOP/s")
    for line in fp8_table_lines(results):
        print(line)
    print("ptxattn-fp8 over its peers (TFLOP/s)")
    for row in results:
        print(f"  {fp8_ratio_line(row)}")
    if torch is not None:
        print("forward + backward of ptxattn.torch.fp8_attention and ptxattn.torch.attention "
              "(TFLOP/s = 3.5 x the forward's FLOPs / time)")
        for row in results:
            print(f"  {torch_ops_line(row)}")
    for note in notes:
        print(f"# {note}")
    flat = [dict({f: row[f] for f in SHAPE_FIELDS if f in row}, **row["backward"],
                 **{f"{name} fwd+bwd ms": t for name, t in row["torch_ops_ms"].items()})
            for row in results]
    write_results(args, flat, results, {"device": props["name"].decode(), "arch": arch,
                                        "nvrtc": nvrtc_text(), "dtype": "bfloat16",
                                        "fp8": "e4m3", "unit": "TFLOP/s", "notes": notes})
    return 0


def visible_pairs(seqlen_q: int, seqlen_k: int, causal: bool, window=(-1, -1)) -> int:
    """(query, key) pairs a mask lets through, bottom-right aligned (mask.cuh)."""
    import numpy as np

    diagonal = np.arange(seqlen_q, dtype=np.int64) + seqlen_k - seqlen_q
    right = 0 if causal else window[1]
    stop = np.minimum(seqlen_k, diagonal + right + 1) if right >= 0 else np.full_like(diagonal, seqlen_k)
    start = np.maximum(0, diagonal - window[0]) if window[0] >= 0 else np.zeros_like(diagonal)
    return int(np.maximum(stop - start, 0).sum())


def varlen_pairs(lengths, causal: bool, window=(-1, -1)) -> int:
    """visible_pairs summed over a varlen batch of sequences of ``lengths`` (self-attention)."""
    return sum(visible_pairs(n, n, causal, window) for n in lengths)


def mixed_lengths(total_tokens: int, shortest: int, longest: int, seed: int = 0) -> list[int]:
    """Sequence lengths from ``shortest`` to ``longest``, drawn log-uniformly (short and long
    sequences alike: a uniform draw would give mostly long ones), each at most what is left of
    ``total_tokens``, until less than ``shortest`` is left: they sum to within ``shortest`` of
    it. The same ``seed`` draws the same lengths on any machine (Python's own generator)."""
    import math
    import random

    draw = random.Random(seed)
    lengths: list[int] = []
    while (left := total_tokens - sum(lengths)) >= shortest:
        top = min(longest, left)
        lengths.append(round(math.exp(draw.uniform(math.log(shortest), math.log(top)))))
    return lengths


def feature_line(title: str, ms: dict, forward_flops: dict, baseline: str) -> str:
    """One --backward-features row: each call's backward TFLOP/s (2.5 x its forward FLOPs) and
    milliseconds, then each other call's time over ``baseline``'s where that ran."""
    cells = ", ".join(f"{name} {2.5 * forward_flops[name] / t / 1e9:.1f} ({t:.3f} ms)"
                      for name, t in ms.items())
    ratios = ", ".join(f"{name} {t / ms[baseline]:.3f}" for name, t in ms.items()
                       if name != baseline and baseline in ms)
    return f"{title}: {cells or 'no call ran'}" + (f"; time / {baseline}'s: {ratios}"
                                                   if ratios else "")


def backward_features_main(args) -> int:
    """The backward of varlen, sliding-window, softcap and sinks calls, each beside the plain
    call it stands for, in TFLOP/s over the (query, key) pairs it computes."""
    import itertools

    import cupy
    import ptxattn
    from ptxattn.runtime import device_arch

    arch = device_arch()
    repeats = args.repeats or (5 if args.quick else 10)
    props = device_props()
    print(f"# {device_line(props, arch)}, dtype {args.dtype}, backward features, "
          f"median of {repeats} runs")
    print("# backward TFLOP/s = 2.5 x 4 x heads x head_dim x the visible (query, key) pairs / "
          "time; fixed-length rows without a window: 4 x B x H x S^2 x D, halved for causal")
    heads, head_dim = 16, 128
    rng = cupy.random.default_rng(0)
    results = []

    def normal(shape):
        return rng.standard_normal(shape, dtype=cupy.float32).astype(args.dtype)

    def pair_flops(pairs):
        return 4.0 * pairs * heads * head_dim

    def measure(title: str, calls: dict, baseline: str, **extra) -> dict:
        """Times name -> (backward call, its forward FLOPs) in shuffled turns, prints the row;
        a call that fails (a feature this GPU or build lacks) is reported and left out."""
        runnable = {}
        for name, (call, _) in calls.items():
            try:
                call()  # compiles, warms
                runnable[name] = call
            except Exception as err:  # noqa: BLE001 - reported, the row goes on without it
                print(f"  ({title}: {name} failed: {type(err).__name__}: {str(err)[-160:]})")
        ms = time_ms_interleaved(runnable, warmup=2, repeats=repeats) if runnable else {}
        forward_flops = {name: work for name, (_, work) in calls.items()}
        print(f"  {feature_line(title, ms, forward_flops, baseline)}")
        results.append(dict(row=title, ms=ms, **extra, backward={
            name: 2.5 * forward_flops[name] / t / 1e9 for name, t in ms.items()}))
        return ms

    def varlen_beside_fixed(causal: bool):
        """8 sequences of 2048 as a varlen batch, on the memory of the fixed-length batch."""
        batch, seqlen = 8, 2048
        q, k, v, dout = (normal((batch, seqlen, heads, head_dim)) for _ in range(4))
        packed = [x.reshape(batch * seqlen, heads, head_dim) for x in (q, k, v, dout)]
        cu = cupy.arange(0, batch * seqlen + 1, seqlen, dtype=cupy.int32)
        out, lse = ptxattn.attention(q, k, v, causal=causal, return_lse=True)
        varlen_out, varlen_lse = ptxattn.attention_varlen(*packed[:3], cu, cu, seqlen, seqlen,
                                                          causal=causal, return_lse=True)
        fixed = functools.partial(ptxattn.attention_backward, dout, q, k, v, out, lse,
                                  causal=causal)
        varlen = functools.partial(ptxattn.attention_varlen_backward, packed[3], *packed[:3],
                                   varlen_out, varlen_lse, cu, cu, seqlen, seqlen,
                                   causal=causal, check_contents=False)
        measure(f"{batch} x {seqlen}{' causal' if causal else ''}", {
            "fixed": (fixed, attention_flops(batch, heads, seqlen, seqlen, head_dim, causal)),
            "varlen": (varlen, pair_flops(batch * visible_pairs(seqlen, seqlen, causal)))},
            "fixed")

    def mixed_varlen(lengths, causal: bool):
        total, longest = sum(lengths), max(lengths)
        q, k, v, dout = (normal((total, heads, head_dim)) for _ in range(4))
        cu = cupy.asarray([0, *itertools.accumulate(lengths)], dtype=cupy.int32)
        out, lse = ptxattn.attention_varlen(q, k, v, cu, cu, longest, longest, causal=causal,
                                            return_lse=True)
        backward = functools.partial(ptxattn.attention_varlen_backward, dout, q, k, v, out,
                                     lse, cu, cu, longest, longest, causal=causal,
                                     check_contents=False)
        measure(f"{len(lengths)} sequences, {total} tokens{' causal' if causal else ''}",
                {"varlen": (backward, pair_flops(varlen_pairs(lengths, causal)))}, "varlen",
                lengths=lengths)

    def window_beside_causal(seqlen: int, window):
        q, k, v, dout = (normal((1, seqlen, heads, head_dim)) for _ in range(4))
        out, lse = ptxattn.attention(q, k, v, causal=True, return_lse=True)
        window_out, window_lse = ptxattn.attention(q, k, v, causal=True, window=window,
                                                   return_lse=True)
        share = (visible_pairs(seqlen, seqlen, True, window)
                 / visible_pairs(seqlen, seqlen, True))
        name = f"window {window}"
        whole = functools.partial(ptxattn.attention_backward, dout, q, k, v, out, lse,
                                  causal=True)
        windowed = functools.partial(ptxattn.attention_backward, dout, q, k, v, window_out,
                                     window_lse, causal=True, window=window)
        ms = measure(f"1 x {seqlen} causal", {
            "causal": (whole, attention_flops(1, heads, seqlen, seqlen, head_dim, True)),
            name: (windowed, pair_flops(visible_pairs(seqlen, seqlen, True, window)))},
            "causal", visible_pairs_share=share)
        if len(ms) == 2:
            time_share = ms[name] / ms["causal"]
            print(f"    {name} sees {share:.4f} of the causal pairs and takes {time_share:.4f} "
                  f"of the causal time: {time_share / share:.3f}x its share")

    def softcap_and_sinks(seqlen: int):
        batch = 16384 // seqlen
        q, k, v, dout = (normal((batch, seqlen, heads, head_dim)) for _ in range(4))
        options = {"plain": {}, "softcap 50": dict(softcap=50.0),
                   "sinks": dict(sinks=rng.standard_normal(heads, dtype=cupy.float32))}
        work = attention_flops(batch, heads, seqlen, seqlen, head_dim, True)
        calls = {}
        for name, option in options.items():
            out, lse = ptxattn.attention(q, k, v, causal=True, return_lse=True, **option)
            calls[name] = (functools.partial(ptxattn.attention_backward, dout, q, k, v, out,
                                             lse, causal=True, **option), work)
        measure(f"{batch} x {seqlen} causal", calls, "plain")

    print(f"varlen against the fixed-length batch on the same memory, {heads} heads, "
          f"head_dim {head_dim}")
    for causal in (False, True):
        varlen_beside_fixed(causal)
    lengths = mixed_lengths(16384, 128, 8192)
    print(f"varlen, mixed lengths (128 to 8192, log-uniform, seed 0): {lengths}")
    for causal in (False, True):
        mixed_varlen(lengths, causal)
    print(f"sliding window against the whole causal sequence, {heads} heads, head_dim {head_dim}")
    window_beside_causal(32768, (4096, 0))
    print(f"softcap and sinks against the plain call, {heads} heads, head_dim {head_dim}")
    for seqlen in (4096, 8192):
        softcap_and_sinks(seqlen)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": props["name"].decode(), "arch": arch, "nvrtc": nvrtc_text(),
                       "dtype": args.dtype, "unit": "TFLOP/s", "results": results}, f, indent=1)
    return 0


# (head_dim, head_dim_v) rows of --head-dims: the dims models use beyond 64/128/256, and 128
# beside them.
HEAD_DIM_ROWS = [(80, 80), (96, 96), (128, 128), (192, 192), (192, 128)]
HEAD_DIM_ROWS_FULL = HEAD_DIM_ROWS + [(40, 40), (64, 64), (160, 160), (256, 256), (128, 64)]


def head_dim_configs(quick: bool) -> list[dict]:
    """--head-dims rows: batch * seqlen = 16384, heads * head_dim about 2048."""
    seqlens = (4096,) if quick else (2048, 8192)
    return [dict(batch=16384 // seqlen, seqlen=seqlen, heads=round(2048 / head_dim),
                 head_dim=head_dim, head_dim_v=head_dim_v, causal=causal)
            for head_dim, head_dim_v in (HEAD_DIM_ROWS if quick else HEAD_DIM_ROWS_FULL)
            for seqlen in seqlens for causal in (False, True)]


def head_dims_main(args) -> int:
    """Forward and backward TFLOP/s at each head dim of head_dim_configs, peers interleaved:
    FlashAttention-3's forward (the fa3-fwd wheel, which compiles 64, 96, 128, 192 and 256 and
    192 with 128-wide values) and torch SDPA's cuDNN and FlashAttention-2, forward and backward.
    FLOPs count the call's own head dims: 2 B H Sq Sk (head_dim + head_dim_v), halved for
    causal, 2.5 times that for the backward."""
    import cupy
    import ptxattn
    from ptxattn.runtime import device_arch

    arch = device_arch()
    repeats = args.repeats or (5 if args.quick else 10)
    props = device_props()
    print(f"# {device_line(props, arch)}, dtype {args.dtype}, head dims, median of {repeats} "
          f"runs")
    try:
        import torch
    except ImportError:
        torch = None
        print(f"{PROG}: torch is not importable, so no SDPA peers in this run", file=sys.stderr)
    fa3 = fa3_runners().get("fa3", (None, None, None))[2]
    results = []
    rows = head_dim_configs(args.quick)
    for index, cfg in enumerate(rows, 1):
        batch, seqlen, heads, causal = cfg["batch"], cfg["seqlen"], cfg["heads"], cfg["causal"]
        d, dv = cfg["head_dim"], cfg["head_dim_v"]
        print(f"\r[{index}/{len(rows)}] {d}/{dv} seqlen {seqlen} causal={causal}", end="",
              file=sys.stderr, flush=True)
        rng = cupy.random.default_rng(index)

        def normal(dim):
            return rng.standard_normal((batch, seqlen, heads, dim),
                                       dtype=cupy.float32).astype(args.dtype)
        q, k, v, dout = normal(d), normal(d), normal(dv), normal(dv)
        out, lse = ptxattn.attention(q, k, v, causal=causal, return_lse=True)
        forward = {"ptxattn": lambda: ptxattn.attention(q, k, v, causal=causal)}
        backward = {"ptxattn": lambda: ptxattn.attention_backward(dout, q, k, v, out, lse,
                                                                   causal=causal)}
        if torch is not None:
            tq, tk, tv = (torch.from_dlpack(x) for x in (q, k, v))
            for name, (_, _, run) in torch_runners().items():
                try:
                    run(tq, tk, tv, causal)
                except RuntimeError as err:
                    print(f"\n{name} {d}/{dv}: {str(err).splitlines()[0]}", file=sys.stderr)
                    continue
                forward[name] = functools.partial(run, tq, tk, tv, causal)
            backward.update({name: calls[0] for name, calls in
                             torch_backward_runners(torch, q, k, v, dout, causal).items()})
            if fa3 is not None:
                try:
                    fa3(tq, tk, tv, causal)
                    forward["fa3"] = functools.partial(fa3, tq, tk, tv, causal)
                except RuntimeError as err:
                    print(f"\nfa3 {d}/{dv}: {str(err).splitlines()[0]}", file=sys.stderr)
        fwd_flops = 2.0 * batch * heads * seqlen * seqlen * (d + dv) / (2 if causal else 1)
        results.append(dict(cfg, **{
            kind: {n: scale * fwd_flops / ms / 1e9 for n, ms in
                   time_ms_interleaved(calls, warmup=2, repeats=repeats).items()}
            for kind, calls, scale in (("forward", forward, 1.0),
                                       ("backward", backward, 2.5))}))
    print("\r" + " " * 80 + "\r", end="", file=sys.stderr)
    for kind in ("forward", "backward"):
        names = list(dict.fromkeys(n for r in results for n in r[kind]))
        widths = [max(len(n), 7) for n in names]
        print(f"{kind} TFLOP/s")
        print(f"{'batch':>5} {'seqlen':>6} {'heads':>5} {'dim':>7} {'causal':>6} "
              + " ".join(f"{n:>{w}}" for n, w in zip(names, widths)) + "  ptxattn/best peer")
        for row in results:
            cells = " ".join(f"{row[kind][n]:{w}.1f}" if n in row[kind] else f"{'-':>{w}}"
                             for n, w in zip(names, widths))
            peers = [t for n, t in row[kind].items() if n != "ptxattn"]
            ratio = f"{row[kind]['ptxattn'] / max(peers):17.3f}" if peers else f"{'-':>17}"
            dims = f"{row['head_dim']}/{row['head_dim_v']}"
            print(f"{row['batch']:5d} {row['seqlen']:6d} {row['heads']:5d} {dims:>7} "
                  f"{str(row['causal']):>6} {cells}  {ratio}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": props["name"].decode(), "arch": arch, "nvrtc": nvrtc_text(),
                       "dtype": args.dtype, "unit": "TFLOP/s", "results": results}, f, indent=1)
    return 0


# --serving's parts, in the order they run: --mla and --fp8-cache pick theirs alone.
SERVING_SECTIONS = ("decode", "prefill", "mla", "fp8-cache")

# MLA's widths (DeepSeek-V2/V3): a cache row is the 512-wide latent, which is also the value,
# and the 64 rotary dims; the queries are as wide, absorbed into the latent.
MLA_LATENT, MLA_ROTARY = 512, 64
MLA_WIDTH = MLA_LATENT + MLA_ROTARY


def serving_sections(mla: bool, fp8_cache: bool) -> tuple:
    """The parts of SERVING_SECTIONS a --serving run takes: all, or those --mla and
    --fp8-cache name."""
    if not (mla or fp8_cache):
        return SERVING_SECTIONS
    return tuple(s for s, chosen in (("mla", mla), ("fp8-cache", fp8_cache)) if chosen)


def mla_shapes(quick: bool) -> list[dict]:
    """--serving's MLA rows, grouped by cache (batch, keys), which they share: one new token at
    128 query heads and at 16 (a tensor-parallel rank's slice, memory-bound), batch 64 and 128
    over 4096 and 16384 keys; and 2 and 4 new tokens at 128 heads over 4096 keys, which are
    compute-bound. --quick: batch 64 alone."""
    rows = []
    for batch in (64,) if quick else (64, 128):
        for keys in (4096, 16384):
            rows += [dict(batch=batch, keys=keys, heads=heads, seqlen_q=1) for heads in (128, 16)]
            if keys == 4096:
                rows += [dict(batch=batch, keys=keys, heads=128, seqlen_q=sq) for sq in (2, 4)]
    return rows


def mla_flops(batch: int, seqlen_q: int, heads: int, keys: int) -> float:
    """MLA decode's FLOPs: 2 B Sq H L (576 + 512), Q K^T over the 576-wide rows and P V over the
    512-wide values, every query row over all L keys (a causal step of Sq tokens masks a few
    of the last Sq - 1 keys, which this leaves in)."""
    return 2.0 * batch * seqlen_q * heads * keys * (MLA_WIDTH + MLA_LATENT)


def cache_read_line(title: str, ms: dict, cache_bytes, copy_gbs: float, flops=None,
                    ratios=None) -> str:
    """One --serving decode row: each call's GB/s of cache bytes read (``cache_bytes``: one
    count for every call, or name -> count), its fraction of ``copy_gbs`` in parentheses and,
    with ``flops`` (one count or name -> count), its TFLOP/s; then ``ratios``, label ->
    (name, baseline name), as baseline's time over name's (tokens/s of name over baseline's)
    where both ran."""
    def per(x, name):
        return x[name] if isinstance(x, dict) else x
    cells = []
    for name, t in ms.items():
        gbs = per(cache_bytes, name) / t / 1e6
        cell = f"{name} {gbs:.0f} ({gbs / copy_gbs:.2f})"
        if flops is not None:
            cell += f" {per(flops, name) / t / 1e9:.0f} TFLOP/s"
        cells.append(cell)
    shown = ", ".join(f"{label} {ms[base] / ms[name]:.2f}"
                      for label, (name, base) in (ratios or {}).items()
                      if name in ms and base in ms)
    return f"{title}: {', '.join(cells) or 'no call ran'}" + (
        f"; tokens/s e4m3 over 16-bit: {shown}" if shown else "")


def first_error(call) -> str | None:
    """None where ``call()`` runs, else its error's type and first line."""
    try:
        call()
    except Exception as err:  # noqa: BLE001 - what a peer lacks, reported
        return f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[0][:200]}"
    return None


def e4m3_cache(cache):
    """A 16-bit cache (..., heads, dim) in e4m3 with one descale (ptxattn.fp8.quantize per
    tensor): (E4M3Array of the cache's shape, float32 descale of shape (1,)). The quantizer takes
    head dims up to 256, so a wider row (MLA's 576) is quantized as rows of 256, 128 or 64,
    which one tensor-wide descale leaves the same."""
    from ptxattn import fp8
    *lead, heads, dim = cache.shape
    width = next(w for w in (256, 128, 64) if dim % w == 0)
    x8, descale = fp8.quantize(cache.reshape(*lead, heads * dim // width, width), "tensor")
    return fp8.E4M3Array(x8.bytes.reshape(cache.shape)), descale.reshape(1)


def serving_main(args) -> int:
    """Decode in GB/s of K/V read beside the copy bandwidth, paged against contiguous caches,
    varlen against fixed-length prefill, chunked prefill and a sliding window, in TFLOP/s; MLA
    decode (16-bit and e4m3 caches) in GB/s and TFLOP/s; e4m3 caches against 16-bit ones.
    --mla and --fp8-cache run their parts alone (serving_sections)."""
    import itertools

    import cupy
    import numpy as np
    import ptxattn
    from ptxattn.runtime import device_arch

    arch = device_arch()
    repeats = args.repeats or (5 if args.quick else 10)
    sections = serving_sections(args.mla, args.fp8_cache)
    print(f"# {device_line(device_props(), arch)}, dtype {args.dtype}, serving, "
          f"median of {repeats} runs")
    try:
        import torch
        from torch.nn.functional import scaled_dot_product_attention as sdpa
    except ImportError:
        torch = None
        print(f"{PROG}: torch is not importable, so no SDPA peers in this run",
              file=sys.stderr)
    fa3 = None
    if torch is not None:
        try:
            import fa3_fwd_config
            sys.modules.setdefault("flash_attn_config", fa3_fwd_config)
            import fa3_fwd_interface as fa3
        except (ImportError, OSError):
            print(f"{PROG}: fa3_fwd_interface is not importable, so no FlashAttention-3 "
                  "peers in this run", file=sys.stderr)
    rng = np.random.default_rng(0)
    short = {"bfloat16": "bf16", "float16": "fp16"}[args.dtype]

    def normal(shape):
        return cupy.asarray(rng.standard_normal(shape, dtype=np.float32)).astype(args.dtype)

    def device_normal(shape, seed):
        """normal drawn on the GPU: the MLA caches (up to 128 x 16384 x 576) would take a
        while from the host's generator."""
        return cupy.random.default_rng(seed).standard_normal(
            shape, dtype=cupy.float32).astype(args.dtype)

    def as_torch(*xs):
        """Torch views of CuPy arrays, and of E4M3Arrays' bytes as float8_e4m3fn."""
        return tuple(torch.from_dlpack(x.bytes).view(torch.float8_e4m3fn)
                     if isinstance(getattr(x, "bytes", None), cupy.ndarray)
                     else torch.from_dlpack(x) for x in xs)

    def paged(*caches, page_size):
        """Paged copies of the caches (batch, seqlen, heads, dim), their pages shuffled by one
        block table."""
        batch, seqlen = caches[0].shape[:2]
        per_seq = seqlen // page_size
        table = rng.permutation(batch * per_seq).reshape(batch, per_seq).astype(np.int32)
        pools = []
        for cache in caches:
            page_shape = (batch * per_seq, page_size) + cache.shape[2:]
            pool = cupy.empty(page_shape, dtype=cache.dtype)
            pool[cupy.asarray(table.ravel())] = cache.reshape(page_shape)
            pools.append(pool)
        return (*pools, cupy.asarray(table))

    def runnable(calls: dict) -> dict:
        """The calls that run (each called once: compiles, warms); a peer that refuses a shape
        is reported, not fatal."""
        kept = {}
        for name, call in calls.items():
            try:
                call()
                kept[name] = call
            except Exception as err:
                print(f"  ({name} failed: {type(err).__name__}: {str(err)[-160:]})")
        return kept

    def fa3_descale(descale, batch, heads_kv):
        """A tensor-wide descale as FlashAttention-3 takes it: one per (batch, kv head)."""
        return torch.from_dlpack(descale).reshape(1, 1).expand(batch, heads_kv).contiguous()

    copy_src = cupy.empty(2 ** 31, dtype=cupy.uint8)
    copy_dst = cupy.empty_like(copy_src)
    copy_ms = time_ms_interleaved({"copy": lambda: copy_dst.__setitem__(Ellipsis, copy_src)},
                                  warmup=2, repeats=repeats)["copy"]
    copy_gbs = 2 * copy_src.nbytes / copy_ms / 1e6
    print(f"copy bandwidth (read + write): {copy_gbs:.0f} GB/s")

    if "decode" in sections:
        print("decode, 32/8 heads, head_dim 128, one new token: GB/s of K/V read "
              "(fraction of copy bandwidth)")
        for batch, seqlen in ((64, 8192), (8, 32768)):
            q = normal((batch, 1, 32, 128))
            k, v = normal((batch, seqlen, 8, 128)), normal((batch, seqlen, 8, 128))
            lengths = cupy.full(batch, seqlen, dtype=cupy.int32)

            def contiguous():
                return ptxattn.attention_with_kvcache(q, k, v, cache_seqlens=lengths,
                                                      check_contents=False)

            # The caches take turns among themselves, apart from the peers: a peer reads the
            # same arrays as the contiguous cache, so its turn would leave the contiguous
            # cache's address translations warm and the pages' cold (H100, batch 8 x 32768:
            # 64-row pages read 0.962-0.965 of the contiguous cache where every turn followed
            # another cache's, 0.951-0.962 with the fixed-length kernel or torch SDPA also
            # taking turns; a 4-stage ring, which needs warm translations, 0.88 against 0.98;
            # measured on 2026-11-26, docs/design/serving.md#address-translations). Taking
            # turns, each cache starts every sample after another's reads, as it would after
            # other layers. The MLA and e4m3 rows below group their calls the same way.
            layouts = {"ptxattn-contiguous": contiguous}
            for page_size in (16, 64):
                kp, vp, table = paged(k, v, page_size=page_size)
                layouts[f"ptxattn-paged{page_size}"] = (
                    lambda kp=kp, vp=vp, table=table: ptxattn.attention_with_kvcache(
                        q, kp, vp, cache_seqlens=lengths, block_table=table,
                        check_contents=False))
            calls = {"ptxattn": contiguous,
                     "ptxattn-fixed-length": lambda: ptxattn.attention(q, k, v)}
            if torch is not None:
                tq, tk, tv = as_torch(q, k, v)
                calls["torch-sdpa"] = lambda: sdpa(tq.transpose(1, 2), tk.transpose(1, 2),
                                                   tv.transpose(1, 2), enable_gqa=True)
            if fa3 is not None:
                tlen = torch.from_dlpack(lengths)
                calls["fa3"] = lambda: fa3.flash_attn_with_kvcache(
                    tq, tk, tv, cache_seqlens=tlen, causal=True)
            kv_bytes = 2 * k.nbytes
            for title, group in (("caches", layouts), ("peers", calls)):
                ms = time_ms_interleaved(runnable(group), warmup=3, repeats=repeats)
                print("  " + cache_read_line(f"batch {batch:3d} seqlen_k {seqlen:6d}, {title}",
                                             ms, kv_bytes, copy_gbs))
            del q, k, v, calls, layouts

    if "prefill" in sections:
        print("prefill, TFLOP/s over the visible (query, key) pairs, 32 heads (8 kv), "
              "head_dim 128")

        def report(title, calls, pairs):
            ms = time_ms_interleaved(runnable(calls), warmup=3, repeats=repeats)
            print(f"  {title}: " + ", ".join(f"{name} {4 * pairs * 128 * 32 / t / 1e9:.0f}"
                                             for name, t in ms.items()))

        # varlen against fixed length: 8 sequences of 2048 tokens, causal
        q = normal((8, 2048, 32, 128))
        k, v = normal((8, 2048, 8, 128)), normal((8, 2048, 8, 128))
        cu = cupy.arange(0, 8 * 2048 + 1, 2048, dtype=cupy.int32)
        flat = [x.reshape(-1, x.shape[2], 128) for x in (q, k, v)]
        calls = {"ptxattn-fixed": lambda: ptxattn.attention(q, k, v, causal=True),
                 "ptxattn-varlen": lambda: ptxattn.attention_varlen(
                     *flat, cu, cu, 2048, 2048, causal=True, check_contents=False)}
        if fa3 is not None:
            tq, tk, tv = as_torch(*flat)
            tcu = torch.from_dlpack(cu)
            calls["fa3-varlen"] = lambda: fa3.flash_attn_varlen_func(
                tq, tk, tv, tcu, tcu, 2048, 2048, causal=True)
        report("varlen 8 x 2048 causal", calls, 8 * visible_pairs(2048, 2048, True))

        # chunked prefill: new tokens over a 16k cache. "ptxattn" is what dispatch picks (the
        # decode kernel below problem.DECODE_QUERIES tokens, the Hopper serving build from
        # there); the two kernels are also timed by name, to show where the crossover lies.
        from ptxattn import problem as problem_module
        from ptxattn.launchers import hopper_forward

        k, v = normal((1, 16384, 8, 128)), normal((1, 16384, 8, 128))
        lengths = cupy.full(1, 16384, dtype=cupy.int32)
        kp, vp, table = paged(k, v, page_size=64)
        for chunk in (16, 64, 256):
            q = normal((1, chunk, 32, 128))
            calls = {"ptxattn": lambda: ptxattn.attention_with_kvcache(
                         q, k, v, cache_seqlens=lengths, check_contents=False),
                     "ptxattn-decode-kernel": lambda: ptxattn.attention_with_kvcache(
                         q, k, v, cache_seqlens=lengths, check_contents=False,
                         backend="portable")}
            if arch in hopper_forward.ARCHS:
                chunk_problem = problem_module.AttentionProblem.from_kvcache(
                    q, k, v, cache_seqlens=lengths)
                out = cupy.empty_like(q)
                lse = cupy.empty(chunk_problem.lse_shape, dtype=cupy.float32)
                calls["ptxattn-hopper-serving"] = lambda p=chunk_problem, q=q, out=out, lse=lse: (
                    hopper_forward.serve(p, q, k, v, out, lse, seqused_k=lengths))
            if chunk == 256:
                calls["ptxattn-paged64"] = lambda: ptxattn.attention_with_kvcache(
                    q, kp, vp, cache_seqlens=lengths, block_table=table, check_contents=False)
            if fa3 is not None:
                tq, tk, tv = as_torch(q, k, v)
                tlen = torch.from_dlpack(lengths)
                calls["fa3"] = lambda tq=tq, tk=tk, tv=tv: fa3.flash_attn_with_kvcache(
                    tq, tk, tv, cache_seqlens=tlen, causal=True)
                if chunk == 256:
                    tkp, tvp, ttable = as_torch(kp, vp, table)
                    calls["fa3-paged64"] = lambda: fa3.flash_attn_with_kvcache(
                        tq, tkp, tvp, cache_seqlens=tlen, page_table=ttable, causal=True)
            report(f"chunked prefill {chunk} over 16384", calls,
                   visible_pairs(chunk, 16384, True))
        del k, v, kp, vp

        # sliding window 4096 over 32k, against the whole causal sequence
        q, k, v = (normal((32768, h, 128)) for h in (32, 8, 8))
        cu = cupy.asarray(np.array([0, 32768], dtype=np.int32))
        for window in ((4096, 0), (-1, -1)):
            calls = {"ptxattn": lambda w=window: ptxattn.attention_varlen(
                q, k, v, cu, cu, 32768, 32768, causal=True, window=w, check_contents=False)}
            if fa3 is not None:
                tq, tk, tv = as_torch(q[None], k[None], v[None])
                calls["fa3"] = lambda w=window: fa3.flash_attn_func(tq, tk, tv, causal=True,
                                                                    window_size=w)
            report(f"seqlen 32768 causal window {window}", calls,
                   visible_pairs(32768, 32768, True, window))
        del q, k, v, calls

    if "mla" in sections:
        print(f"MLA decode (attention_mla_decode): q and one cache head {MLA_WIDTH} wide "
              f"({MLA_LATENT} latent, which are the values, + {MLA_ROTARY} rotary), {short} and "
              "e4m3 caches (one descale), contiguous and in pages of 64: GB/s of cache read "
              f"(fraction of copy bandwidth), TFLOP/s = 2 B Sq H L ({MLA_WIDTH} + {MLA_LATENT})"
              " / time")

        def fa3_mla(q, kv, lengths, table=None, q_descale=None, kv_descale=None):
            """FlashAttention-3's MLA call: q the rotary dims, qv the latent ones; the cache
            as views of the same rows, k the rotary dims and v the latent ones (as vLLM's
            FlashAttention MLA backend passes them)."""
            q_rope, q_latent = (q[..., MLA_LATENT:].contiguous(),
                                q[..., :MLA_LATENT].contiguous())
            k_rope, v_latent = kv[..., MLA_LATENT:], kv[..., :MLA_LATENT]
            scales = {} if q_descale is None else dict(
                q_descale=q_descale, k_descale=kv_descale, v_descale=kv_descale)
            return lambda: fa3.flash_attn_with_kvcache(
                q_rope, k_rope, v_latent, qv=q_latent, cache_seqlens=lengths, page_table=table,
                causal=True, **scales)

        fa3_takes = {}  # "contiguous", "paged64", "e4m3" -> whether FlashAttention-3 runs it
        if fa3 is not None:
            # A small call of each kind first: what this build of FlashAttention-3 lacks is
            # said once, here, and left out of the rows (fa3-fwd 0.0.3 compiles the 64/512 MLA
            # kernels for bf16 alone, and no paged KV: FLASHATTENTION_DISABLE_PAGEDKV).
            dtype = getattr(torch, args.dtype)
            pq = torch.randn(1, 1, 16, MLA_WIDTH, device="cuda", dtype=dtype)
            pkv = torch.randn(4, 64, 1, MLA_WIDTH, device="cuda", dtype=dtype)
            plen = torch.full((1,), 256, dtype=torch.int32, device="cuda")
            ptable = torch.arange(4, dtype=torch.int32, device="cuda").reshape(1, 4)
            one = torch.ones(1, 1, dtype=torch.float32, device="cuda")
            fp8 = torch.float8_e4m3fn
            probes = {
                "contiguous": fa3_mla(pq, pkv.reshape(1, 256, 1, MLA_WIDTH), plen),
                "paged64": fa3_mla(pq, pkv, plen, ptable),
                "e4m3": fa3_mla(pq.to(fp8), pkv.reshape(1, 256, 1, MLA_WIDTH).to(fp8), plen,
                                q_descale=one, kv_descale=one)}
            for kind, call in probes.items():
                error = first_error(call)
                fa3_takes[kind] = error is None
                if error is not None:
                    print(f"  # fa3 has no {kind} MLA here ({error}): no fa3 peer of that kind")
            del pq, pkv, probes

        groups = itertools.groupby(mla_shapes(args.quick), key=lambda r: (r["batch"], r["keys"]))
        for index, ((batch, keys), shapes) in enumerate(groups):
            kv = device_normal((batch, keys, 1, MLA_WIDTH), 100 + index)
            kv_pages, table = paged(kv, page_size=64)
            kv8, kv_descale = e4m3_cache(kv)
            kv8_pages, _ = e4m3_cache(kv_pages)  # the same values: the same descale
            lengths = cupy.full(batch, keys, dtype=cupy.int32)
            cache_bytes = collections.defaultdict(lambda: kv.nbytes)
            cache_bytes.update({name: kv8.bytes.nbytes for name in
                                ("e4m3", "e4m3-paged64", "fa3-e4m3")})
            if fa3 is not None:
                tkv, tkv_pages, tkv8, ttable, tlen = as_torch(kv, kv_pages, kv8, table, lengths)
            for shape in shapes:
                heads, seqlen_q = shape["heads"], shape["seqlen_q"]
                q = device_normal((batch, seqlen_q, heads, MLA_WIDTH), 200 + index)

                def mla(cache, block_table=None, descale=None):
                    scale = {} if descale is None else {"kv_descale": descale}
                    return lambda: ptxattn.attention_mla_decode(
                        q, cache, cache_seqlens=lengths, block_table=block_table,
                        check_contents=False, **scale)

                caches = {short: mla(kv), f"{short}-paged64": mla(kv_pages, table),
                          "e4m3": mla(kv8, None, kv_descale),
                          "e4m3-paged64": mla(kv8_pages, table, kv_descale)}
                peers = {"ptxattn": mla(kv)}
                if fa3_takes.get("contiguous"):
                    (tq,) = as_torch(q)
                    peers["fa3"] = fa3_mla(tq, tkv, tlen)
                    if fa3_takes.get("paged64"):
                        peers["fa3-paged64"] = fa3_mla(tq, tkv_pages, tlen, ttable)
                    if fa3_takes.get("e4m3"):
                        q8, q_descale = e4m3_cache(q)
                        (tq8,) = as_torch(q8)
                        peers["fa3-e4m3"] = fa3_mla(
                            tq8, tkv8, tlen, q_descale=fa3_descale(q_descale, batch, 1),
                            kv_descale=fa3_descale(kv_descale, batch, 1))
                ratios = {"contiguous": ("e4m3", short),
                          "paged64": ("e4m3-paged64", f"{short}-paged64"),
                          "fa3": ("fa3-e4m3", "fa3")}
                flops = mla_flops(batch, seqlen_q, heads, keys)
                for title, group in (("caches", caches), ("peers", peers)):
                    ms = time_ms_interleaved(runnable(group), warmup=3, repeats=repeats)
                    print("  " + cache_read_line(
                        f"batch {batch:3d} seqlen_k {keys:6d} heads {heads:3d} seqlen_q "
                        f"{seqlen_q}, {title}", ms, cache_bytes, copy_gbs, flops, ratios))
                del q, caches, peers
            del kv, kv_pages, kv8, kv8_pages, table, lengths
            if fa3 is not None:
                del tkv, tkv_pages, tkv8, ttable, tlen

    if "fp8-cache" in sections:
        batch, seqlen, heads, heads_kv = 64, 8192, 32, 8
        print(f"e4m3 KV cache against {short}, decode, {heads}/{heads_kv} heads, head_dim 128, "
              "one new token, one descale for each of K and V: GB/s of K/V read (fraction of "
              "copy bandwidth); FlashAttention-3's e4m3 takes e4m3 queries too")
        q = device_normal((batch, 1, heads, 128), 300)
        k = device_normal((batch, seqlen, heads_kv, 128), 301)
        v = device_normal((batch, seqlen, heads_kv, 128), 302)
        lengths = cupy.full(batch, seqlen, dtype=cupy.int32)
        kp, vp, table = paged(k, v, page_size=64)
        (k8, k_descale), (v8, v_descale) = e4m3_cache(k), e4m3_cache(v)
        (kp8, _), (vp8, _) = e4m3_cache(kp), e4m3_cache(vp)

        def kvcache(k_cache, v_cache, block_table=None, descales=None):
            scales = {} if descales is None else dict(k_descale=descales[0],
                                                      v_descale=descales[1])
            return lambda: ptxattn.attention_with_kvcache(
                q, k_cache, v_cache, cache_seqlens=lengths, block_table=block_table,
                check_contents=False, **scales)

        descales = (k_descale, v_descale)
        caches = {short: kvcache(k, v), f"{short}-paged64": kvcache(kp, vp, table),
                  "e4m3": kvcache(k8, v8, None, descales),
                  "e4m3-paged64": kvcache(kp8, vp8, table, descales)}
        peers = {"ptxattn": kvcache(k, v), "ptxattn-e4m3": kvcache(k8, v8, None, descales)}
        if fa3 is not None:
            tq, tk, tv, tk8, tv8, tlen = as_torch(q, k, v, k8, v8, lengths)
            q8, q_descale = e4m3_cache(q)
            (tq8,) = as_torch(q8)
            fa3_scales = {name: fa3_descale(d, batch, heads_kv) for name, d in
                          (("q_descale", q_descale), ("k_descale", k_descale),
                           ("v_descale", v_descale))}
            peers["fa3"] = lambda: fa3.flash_attn_with_kvcache(tq, tk, tv, cache_seqlens=tlen,
                                                               causal=True)
            peers["fa3-e4m3"] = lambda: fa3.flash_attn_with_kvcache(
                tq8, tk8, tv8, cache_seqlens=tlen, causal=True, **fa3_scales)
        cache_bytes = collections.defaultdict(lambda: 2 * k.nbytes)
        cache_bytes.update({name: 2 * k8.bytes.nbytes for name in
                            ("e4m3", "e4m3-paged64", "ptxattn-e4m3", "fa3-e4m3")})
        ratios = {"contiguous": ("e4m3", short),
                  "paged64": ("e4m3-paged64", f"{short}-paged64"),
                  "ptxattn": ("ptxattn-e4m3", "ptxattn"), "fa3": ("fa3-e4m3", "fa3")}
        for title, group in (("caches", caches), ("peers", peers)):
            ms = time_ms_interleaved(runnable(group), warmup=3, repeats=repeats)
            print("  " + cache_read_line(f"batch {batch:3d} seqlen_k {seqlen:6d}, {title}", ms,
                                         cache_bytes, copy_gbs, ratios=ratios))
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ptxattn profile", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a few shapes, fewer repeats")
    parser.add_argument("--backward", action="store_true",
                        help="the backward pass and forward + backward instead of the forward")
    parser.add_argument("--fp8", action="store_true",
                        help="with --backward: the FP8 e4m3 backward rows (ptxattn's FP8 and "
                             "bf16 backward, cuDNN's FP8 and bf16) and the torch ops' forward "
                             "+ backward instead")
    parser.add_argument("--backward-features", action="store_true",
                        help="the backward of varlen, sliding-window, softcap and sinks calls "
                             "beside the plain call each stands for")
    parser.add_argument("--serving", action="store_true",
                        help="decode (GB/s), paged, varlen, chunked and sliding-window prefill, "
                             "MLA decode and e4m3 caches")
    parser.add_argument("--mla", action="store_true",
                        help="with --serving: its MLA decode rows alone (16-bit and e4m3 "
                             "caches, contiguous and paged)")
    parser.add_argument("--fp8-cache", action="store_true",
                        help="with --serving: its e4m3 KV cache rows alone (beside 16-bit "
                             "caches); with --mla, both")
    parser.add_argument("--head-dims", action="store_true",
                        help="forward and backward at head dims beyond 64/128/256 (80, 96, 192, "
                             "192 with 128-wide values, ...) beside FlashAttention-3 and cuDNN")
    parser.add_argument("--shapes", help="with --backward: head_dim x seqlen pairs to run, "
                                         "e.g. 128x16384,64x2048 (default: the standard sweep; "
                                         "with --fp8, its rows)")
    parser.add_argument("--csv", help="write the results to this CSV file")
    parser.add_argument("--json", help="write the results to this JSON file")
    parser.add_argument("--plot", metavar="FILE.png",
                        help="draw TFLOP/s against seqlen into this image (needs matplotlib)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--slow-max-seqlen", type=int, default=2048,
                        help="longest seqlen for the slow rows: the CuPy reference and the "
                             "block-scaled emulation build (0: none of them)")
    parser.add_argument("--grid", choices=["sweep", "targets"], default="sweep",
                        help="forward rows: the standard sweep, or the rows ptxattn is measured "
                             "against FlashAttention-3 and cuDNN on (TARGET_SHAPES, GQA "
                             "included), each with its ratio to the best peer")
    parser.add_argument("--energy", action="store_true",
                        help="forward rows: also the energy per call of ptxattn-hopper, "
                             "ptxattn-fp8-head and their peers, each run alone (NVML; slow)")
    parser.add_argument("--energy-window", type=float, default=2.0, metavar="SECONDS",
                        help="with --energy: how long each runner runs alone per sample")
    args = parser.parse_args(argv)
    modes = [mode for mode, chosen in (("--backward", args.backward),
                                       ("--backward-features", args.backward_features),
                                       ("--serving", args.serving),
                                       ("--head-dims", args.head_dims)) if chosen]
    if len(modes) > 1:
        parser.error(f"{' and '.join(modes)} are runs of their own: one at a time")
    if (args.mla or args.fp8_cache) and not args.serving:
        parser.error("--mla and --fp8-cache pick rows of --serving: add --serving")
    if args.fp8 and not args.backward:
        parser.error("--fp8 picks the FP8 rows of --backward: add --backward")
    if args.fp8 and args.dtype != "bfloat16":
        parser.error("--backward --fp8 rows are bfloat16 (FP8's backward takes a bfloat16 "
                     "dout): not with --dtype float16")
    if args.energy and modes:
        parser.error("--energy measures the forward rows: not with --backward, "
                     "--backward-features or --serving")
    if args.energy and args.energy_window < 0.5:
        parser.error("--energy-window must be at least 0.5 s: NVML's counter moves in steps of "
                     "tens of milliseconds")
    if args.grid != "sweep" and (modes or args.quick):
        parser.error("--grid targets is a forward grid of its own: not with --backward, "
                     "--backward-features, --serving or --quick")
    if args.plot:
        if args.serving or args.backward_features or args.fp8:
            parser.error("--plot draws the forward or --backward sweep, not --serving, "
                         "--backward-features or --backward --fp8")
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print(f"{PROG} --plot needs matplotlib: pip install 'ptxattn[plot]'",
                  file=sys.stderr)
            return 2

    from .doctor import gpu_problem
    problem = gpu_problem()
    if problem:
        print(f"{PROG}: nothing to measure without a GPU: {problem}\n"
              f"{PROG}: python -m ptxattn doctor says what this machine has", file=sys.stderr)
        return 2
    import cupy
    if args.backward:
        return backward_fp8_main(args) if args.fp8 else backward_main(args)
    if args.backward_features:
        return backward_features_main(args)
    if args.serving:
        return serving_main(args)
    if args.head_dims:
        return head_dims_main(args)

    from ptxattn import reference
    from ptxattn.runtime import device_arch

    arch = device_arch()
    repeats = args.repeats or (5 if args.quick else 15)
    runners = ptxattn_runners(arch)
    runners.update(fp8_runners(arch))
    scaled, notes = blockscaled_runners(arch, args.slow_max_seqlen)
    runners.update(scaled)
    peers = torch_runners()
    if "torch-sdpa-flash" not in peers:
        print(f"{PROG}: torch is not importable, so no SDPA peers in this run", file=sys.stderr)
    cupy_dtype = cupy.dtype(args.dtype)
    torch = None
    if peers:
        import torch
    runners.update(peers)
    fa3 = fa3_runners()
    if not fa3:
        print(f"{PROG}: fa3_fwd_interface (pip package fa3-fwd) is not importable, so no "
              "FlashAttention-3 peers in this run", file=sys.stderr)
    runners.update(fa3)
    if fa3 and torch is None:
        import torch
    runners["cupy-reference"] = (
        (64, 128, 256), args.slow_max_seqlen, lambda q, k, v, causal: reference.attention(q, k, v, causal=causal))

    props = device_props()
    print(f"# {device_line(props, arch)}, dtype {args.dtype}, median of {repeats} runs")
    for note in notes:
        print(f"# {note}")
    nvml = None
    if args.energy:
        nvml = Nvml.open(cupy.cuda.Device().pci_bus_id)
        if nvml is None:
            print(f"{PROG}: NVML or its energy counter is not available here, so no energy "
                  "per call in this run", file=sys.stderr)
    results = []
    rows = target_configs() if args.grid == "targets" else configs(args.quick)
    for index, cfg in enumerate(rows, 1):
        shape = (cfg["batch"], cfg["seqlen"], cfg["heads"], cfg["head_dim"])
        kv_shape = shape[:2] + (cfg.get("heads_kv", cfg["heads"]), shape[3])
        rng = cupy.random.default_rng(index)
        q = rng.standard_normal(shape, dtype=cupy.float32).astype(cupy_dtype)
        k, v = (rng.standard_normal(kv_shape, dtype=cupy.float32).astype(cupy_dtype)
                for _ in range(2))
        tensors = None
        row = dict(cfg)
        calls = {}
        for name, (dims, max_seqlen, run) in runners.items():
            print(f"\r[{index}/{len(rows)}] {shape} causal={cfg['causal']} {name:<22}",
                  end="", file=sys.stderr, flush=True)
            row[name] = None
            if cfg["head_dim"] not in dims or (max_seqlen is not None and
                                               cfg["seqlen"] > max_seqlen):
                continue
            if name.startswith(TORCH_PEERS):
                if tensors is None:
                    tensors = tuple(torch.from_dlpack(x) for x in (q, k, v))
                inputs = tensors
            else:
                inputs = (q, k, v)
            call = functools.partial(run, *inputs, cfg["causal"])
            try:
                call()  # compiles, quantizes, or finds the shape unsupported
            except Exception as err:  # a peer that cannot run this shape is reported, not fatal
                print(f"\n{name} failed on {shape}: {type(err).__name__}: {err}", file=sys.stderr)
                continue
            calls[name] = call
        # Every runner is timed in the same rounds, so none inherits a cooler or hotter GPU.
        for name, ms in time_ms_interleaved(calls, warmup=3, repeats=repeats).items():
            row[name] = flops(cfg) / ms / 1e9
        if nvml is not None:
            measured = {name: calls[name] for name in ENERGY_RUNNERS if name in calls}
            for name, energy in energy_per_call_interleaved(measured, nvml,
                                                            args.energy_window).items():
                if energy.joules <= 0:
                    continue  # the counter did not move in the window: nothing to report
                row[name + " TFLOP/J"] = flops(cfg) / energy.joules / 1e12
                row[name + " W"] = energy.watts
                row[name + " MHz"] = energy.sm_mhz
        results.append(row)
    print("\r" + " " * 80 + "\r", end="", file=sys.stderr)

    names = list(runners)
    widths = [max(len(n), 7) for n in names]
    print("TFLOP/s")
    print(f"{'batch':>5} {'seqlen':>6} {'heads':>5} {'kv':>3} {'dim':>4} {'causal':>6} "
          + " ".join(f"{n:>{w}}" for n, w in zip(names, widths)))
    for row in results:
        cells = " ".join(f"{row[n]:{w}.1f}" if row[n] is not None else f"{'-':>{w}}"
                         for n, w in zip(names, widths))
        print(f"{row['batch']:5d} {row['seqlen']:6d} {row['heads']:5d} "
              f"{row.get('heads_kv', row['heads']):3d} {row['head_dim']:4d} "
              f"{str(row['causal']):>6} {cells}")
    print("ratio to the best peer")
    for line in ratio_lines(results):
        print(f"  {line}")
    if nvml is not None:
        print(f"energy per call (each runner alone for {args.energy_window:g} s, NVML)")
        for line in energy_lines(results):
            print(f"  {line}")
    for note in notes:
        print(f"# {note}")
    write_results(args, results, results, {"device": props["name"].decode(), "arch": arch,
                                           "nvrtc": nvrtc_text(), "dtype": args.dtype,
                                           "unit": "TFLOP/s"})
    if args.plot:
        plot_rows(results, args.plot, f"{props['name'].decode()} ({arch}), {args.dtype}, forward")
    return 0


if __name__ == "__main__":
    sys.exit(main())
