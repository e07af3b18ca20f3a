"""cuDNN's FP8 attention, forward and backward, as a peer of ``ptxattn.fp8``: the SDPA FP8
graphs of cudnn-frontend's Python API (``pygraph.sdpa_fp8`` and ``pygraph.sdpa_fp8_backward``)
on torch tensors laid out (batch, seqlen, heads, head_dim). The profiler imports it on use
(``python -m ptxattn profile --backward --fp8``); nothing else in ptxattn does.

    from ptxattn.tools import cudnn_fp8
    q8, q_descale = cudnn_fp8.quantize_per_tensor(q)          # e4m3 and a (1, 1, 1, 1) descale
    ...
    fwd = cudnn_fp8.forward(q8, k8, v8, q_descale=q_descale, k_descale=k_descale,
                            v_descale=v_descale, causal=True)   # fwd.out e4m3, fwd.lse float32
    grads = cudnn_fp8.backward(dout8, q8, k8, v8, fwd.out, fwd.lse, q_descale=q_descale,
                               k_descale=k_descale, v_descale=v_descale,
                               out_descale=fwd.out_descale, dout_descale=dout_descale,
                               causal=True)                     # calibrates its scales first
    dq, dk, dv = grads.dequantized()                            # bfloat16
    grads = cudnn_fp8.backward(..., scales=grads.scales)        # one call, no calibration

What it needs. torch with CUDA, the ``nvidia-cudnn-frontend`` wheel (``import cudnn``; it installs
with ``pip install --no-deps``: its dependencies, the CuTe DSL and tvm-ffi, serve the wheel's own
Python kernels, not these graphs, which the cuDNN library runs) and libcudnn 9, found as torch
uses it (``load``). Where any is missing, ``load`` and every call raise ``CudnnUnavailable``
saying which; a graph cuDNN declines (a head dim, a mask, a GPU) raises ``CudnnUnsupported``, a
subclass, with cuDNN's reason. A caller that skips the peer catches ``CudnnUnavailable``.

Finding libcudnn. cudnn-frontend dlopens libcudnn itself when imported: from a directory of
``LD_LIBRARY_PATH``, else ``nvidia/cudnn/lib`` under the interpreter's site-packages, else the
bare name ``libcudnn.so.9`` (read at import, so changing the environment afterwards does
nothing). ``load`` imports torch first, then loads the libcudnn torch runs on (the one already
mapped into the process, else ``nvidia/cudnn/lib`` beside torch's package, else under
``CUDNN_PATH``) with ``RTLD_GLOBAL`` before importing cudnn: whichever of its paths
cudnn-frontend then takes resolves to that library (the bare name matches the loaded soname),
unless another libcudnn sits on ``LD_LIBRARY_PATH`` or in site-packages, which ``library_line``
then shows (its version beside torch's).

What cuDNN's FP8 attention takes and gives on Hopper (cudnn-frontend 1.32's checks; Blackwell
takes more):

- q, k, v (and dO) in e4m3, each with one descale: cuDNN has no per-head or per-block scales,
  so its inputs are quantized per tensor (``quantize_per_tensor``), whatever ptxattn's rows use.
  GQA: heads_q a multiple of heads_kv.
- Forward: the output O is e4m3 too (a 16-bit O needs Blackwell and cuDNN 9.13), written with
  ``scale_o``, which has to be known before the call. ``forward`` takes
  scale_o = 1 / (2 v_descale): O is a convex combination of v's rows, so |O| <= max |v| <= 448
  v_descale, and the factor 2 covers the rounding of P below, so O never saturates; its descale
  (``Fp8Forward.out_descale``) is 2 v_descale. The probabilities P are rounded to e4m3 for P V
  with scale_s = 256 (P <= 1 before normalization), descale_s = 1/256. The statistics are the
  float32 natural-log log-sum-exp of the scaled scores, (batch, heads, seqlen_q) as
  ptxattn's lse.
- Backward: q, k, v, O and dO all e4m3 with their descales (O as the forward wrote it, so
  D = rowsum(dO * O) sees O's and dO's e4m3 rounding, where ptxattn's FP8 backward reads a
  16-bit out and dout), and head_dim 128 alone (d_qk = d_v = 128). The gradients come out in
  e4m3 (16-bit gradients need Blackwell and cuDNN 9.13), each written with a scale known before
  the call (scale_dQ, scale_dK, scale_dV), as is the intermediate dS = P (dP - D), rounded to
  e4m3 with scale_dP for dQ = dS K and dK = dS^T Q (dV = P^T dO takes P with scale_s). cuDNN
  reports each one's amax; amax_dP is dS's, or else that of dP = dO V^T, which bounds it at
  softmax scales up to 1/2 (|dS| <= 2 softmax_scale max |dP|): a scale from it does not
  saturate dS either way.
  ``backward`` without ``scales`` calibrates them on the call's own inputs: one call at unit
  scales gives dP's amax (and dV's, which no gradient scale changes), a second with dP's scale
  gives dQ's and dK's, then the call itself runs with every scale the largest power of two
  keeping amax * scale <= 448 (``GradScales.from_amax``): the scales a delayed-scaling recipe
  would converge to on these inputs, the most favourable case for cuDNN's accuracy.
  ``Fp8Backward.scales`` hands them to the next call, which then runs once. ``dequantized``
  gives 16-bit gradients, outside the call.
- Causal: the top-left mask (``use_causal_mask``; FP8's bottom-right mask is Blackwell's), the
  same as ptxattn's bottom-right one when seqlen_q == seqlen_k, so a causal call with other
  lengths raises CudnnUnsupported.

Timing. A backward call here is one cuDNN graph launch writing e4m3 gradients (1 byte an
element where ptxattn writes 2) from an e4m3 O and dO; quantizing dO and dequantizing the
gradients, which a training step would add, are outside it. Graphs are built once per problem
(shapes, strides, mask, scale, determinism, device) and cached with their workspace.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import glob
import math
import os

E4M3_MAX = 448.0  # e4m3's largest finite value
P_SCALE = 256.0  # scale_s: P <= 1, so P * 256 fits e4m3 and its descale is exact

_LIBCUDNN = "libcudnn.so.9"


class CudnnUnavailable(RuntimeError):
    """torch, CUDA, the cudnn-frontend wheel or libcudnn is missing: the message says which."""


class CudnnUnsupported(CudnnUnavailable):
    """cuDNN is here but declines this graph (a head dim, a mask, a GPU): cuDNN's reason."""


def _loaded_libcudnn() -> str | None:
    """The path of the libcudnn 9 already mapped into this process (torch's), if any: the
    file's own name, libcudnn.so.9 or what that links to (libcudnn.so.9.x.y)."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rsplit(None, 1)[-1]
                if os.path.basename(path).startswith(_LIBCUDNN):
                    return path
    except OSError:
        pass
    return None


def _libcudnn_candidates(torch_dir: str) -> list[str]:
    """Where torch's wheels put libcudnn (nvidia-cudnn-cu*: nvidia/cudnn/lib beside torch, or
    another nvidia/*/lib there), then CUDNN_PATH's lib and lib64."""
    site = os.path.dirname(torch_dir)
    paths = sorted(glob.glob(os.path.join(site, "nvidia", "cudnn", "lib", _LIBCUDNN)))
    paths += sorted(set(glob.glob(os.path.join(site, "nvidia", "*", "lib", _LIBCUDNN)))
                    - set(paths))
    root = os.environ.get("CUDNN_PATH")
    if root:
        paths += [os.path.join(root, lib, _LIBCUDNN) for lib in ("lib", "lib64")]
    return [path for path in paths if os.path.exists(path)]


def _load():
    """(torch, cudnn, the libcudnn path loaded), or the CudnnUnavailable of the first try."""
    loaded = _load_once()
    if isinstance(loaded, CudnnUnavailable):
        raise loaded
    return loaded


@functools.lru_cache(maxsize=None)
def _load_once():
    """_import's result or its CudnnUnavailable: the imports and library lookups run once per
    process, also when they fail (a caller asking every row hears the same reason)."""
    try:
        return _import()
    except CudnnUnavailable as err:
        return err


def _import():
    """Imports torch, loads libcudnn and imports cudnn: (torch, cudnn, the libcudnn path)."""
    try:
        import torch
    except ImportError as err:
        raise CudnnUnavailable(f"torch is not importable ({err})") from err
    if not torch.cuda.is_available():
        raise CudnnUnavailable("torch sees no CUDA device")
    # torch's libraries, libcudnn among them, were mapped by its import; the primary context
    # its tensors live in is made here, before cuDNN makes a handle in it
    torch.cuda.init()
    path = _loaded_libcudnn() or next(iter(_libcudnn_candidates(os.path.dirname(torch.__file__))),
                                      None)
    if path is not None:
        try:
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        except OSError as err:
            raise CudnnUnavailable(f"{path} does not load: {err}") from err
    try:
        import cudnn
    except Exception as err:  # noqa: BLE001 - an import error or cudnn's own dlopen failing
        raise CudnnUnavailable(f"cudnn (pip package nvidia-cudnn-frontend) does not import: "
                               f"{type(err).__name__}: {err}") from err
    try:
        cudnn.backend_version()
    except RuntimeError as err:  # cudnn-frontend found no libcudnn: no cudnnGetVersion
        raise CudnnUnavailable(f"cudnn-frontend {cudnn.__version__} found no {_LIBCUDNN} "
                               f"(looked beside torch and under CUDNN_PATH too): {err}") from err
    return torch, cudnn, path


def load():
    """The cudnn module, with libcudnn loaded as the module docstring says.

    Returns
    -------
    module
        cudnn-frontend's ``cudnn``.

    Raises
    ------
    CudnnUnavailable
        torch, a CUDA device, the cudnn-frontend wheel or libcudnn is missing.
    """
    return _load()[1]


def library_line() -> str:
    """cuDNN's version and where it came from, beside torch's, for a results header.

    Raises
    ------
    CudnnUnavailable
        As ``load``.
    """
    torch, cudnn, path = _load()
    return (f"cuDNN {cudnn.backend_version_string()} (cudnn-frontend {cudnn.__version__}, "
            f"{path or 'found by cudnn-frontend'}; torch's {torch.backends.cudnn.version()})")


@dataclasses.dataclass(frozen=True)
class GradScales:
    """The backward's output scales, each multiplying a real value into e4m3: dS (``dp``, cuDNN's
    scale_dP), dQ, dK and dV."""

    dp: float = 1.0
    dq: float = 1.0
    dk: float = 1.0
    dv: float = 1.0

    @staticmethod
    def scale_for(amax: float) -> float:
        """The largest power of two s with amax * s <= 448 (1 for an amax of 0 or not finite)."""
        if not (amax > 0 and math.isfinite(amax)):
            return 1.0
        return 2.0 ** math.floor(math.log2(E4M3_MAX / amax))

    @classmethod
    def from_amax(cls, **amax: float) -> GradScales:
        """Scales from the amaxes cuDNN reported (keywords dp, dq, dk, dv; those left out 1)."""
        return cls(**{name: cls.scale_for(value) for name, value in amax.items()})


@dataclasses.dataclass(frozen=True)
class Fp8Forward:
    """A forward's results.

    Attributes
    ----------
    out : torch.Tensor
        float8_e4m3fn (batch, seqlen_q, heads_q, head_dim), contiguous.
    out_descale : torch.Tensor
        float32 (1, 1, 1, 1): out's real value is out * out_descale.
    lse : torch.Tensor
        float32 (batch, heads_q, seqlen_q), natural log, as ptxattn's.
    amax_out, amax_p : torch.Tensor
        float32 (1, 1, 1, 1): cuDNN's amax of the real output and of P.
    """

    out: object
    out_descale: object
    lse: object
    amax_out: object
    amax_p: object


@dataclasses.dataclass(frozen=True)
class Fp8Backward:
    """A backward's results.

    Attributes
    ----------
    dq, dk, dv : torch.Tensor
        float8_e4m3fn, q's, k's and v's shapes, contiguous.
    dq_descale, dk_descale, dv_descale : torch.Tensor
        float32 (1, 1, 1, 1), the reciprocals of ``scales`` (shared by every call with the same
        scales: read them, do not write them).
    scales : GradScales
        The scales the call ran with: pass them to the next call at these inputs.
    amax : dict
        "dp", "dq", "dk", "dv" -> float32 (1, 1, 1, 1) tensors, cuDNN's amaxes of the real
        values.
    """

    dq: object
    dk: object
    dv: object
    dq_descale: object
    dk_descale: object
    dv_descale: object
    scales: GradScales
    amax: dict

    def dequantized(self, dtype=None):
        """(dq, dk, dv) as real values in ``dtype`` (torch.bfloat16 by default)."""
        return tuple(dequantize(x, d, dtype) for x, d in ((self.dq, self.dq_descale),
                                                          (self.dk, self.dk_descale),
                                                          (self.dv, self.dv_descale)))


def quantize_per_tensor(x):
    """A 16-bit or float32 torch tensor in e4m3 with one descale (amax / 448, 1 for all zeros).

    Parameters
    ----------
    x : torch.Tensor
        Any shape, on a CUDA device.

    Returns
    -------
    x8 : torch.Tensor
        float8_e4m3fn of x's shape, contiguous.
    descale : torch.Tensor
        float32 (1, 1, 1, 1) on x's device.
    """
    torch = _load()[0]
    amax = x.detach().abs().amax().float()
    descale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax)).reshape(1, 1, 1, 1)
    return (x.float() / descale.reshape(())).to(torch.float8_e4m3fn).contiguous(), descale


def dequantize(x8, descale, dtype=None):
    """e4m3 data times its descale, in ``dtype`` (torch.bfloat16 by default)."""
    torch = _load()[0]
    return (x8.float() * descale.reshape(())).to(dtype or torch.bfloat16)


# ---------------------------------------------------------------------------------------------
# Graphs


def _bhsd(shape, strides) -> tuple[tuple, tuple]:
    """A (batch, seqlen, heads, dim) tensor's dims and strides as cuDNN takes them: (b, h, s, d)."""
    b, s, h, d = shape
    sb, ss, sh, sd = strides
    return (b, h, s, d), (sb, sh, ss, sd)


def _stats_layout(batch: int, heads: int, seqlen: int) -> tuple[tuple, tuple]:
    """The statistics' (b, h, s, 1) dims and strides: ptxattn's (batch, heads, seqlen) lse."""
    return (batch, heads, seqlen, 1), (heads * seqlen, seqlen, 1, 1)


_SCALAR = ((1, 1, 1, 1), (1, 1, 1, 1))


@dataclasses.dataclass
class _Plan:
    """A built graph, its tensors by name, and its workspace (allocated on first use)."""

    graph: object
    tensors: dict
    workspace_size: int
    workspace: object = None


def _finish(cudnn, graph, tensors: dict) -> _Plan:
    """Validates and builds ``graph`` (heuristics A, then the fallback list); a graph cuDNN
    declines raises CudnnUnsupported with its reason."""
    try:
        graph.validate()
        graph.build_operation_graph()
        graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        graph.check_support()
        graph.build_plans()
    except cudnn.cudnnGraphNotSupportedError as err:
        raise CudnnUnsupported(f"cuDNN {cudnn.backend_version_string()} declines the graph: "
                               f"{err}") from err
    return _Plan(graph, tensors, graph.get_workspace_size())


def _graph(cudnn, handle):
    return cudnn.pygraph(io_data_type=cudnn.data_type.FP8_E4M3,
                         intermediate_data_type=cudnn.data_type.FLOAT,
                         compute_data_type=cudnn.data_type.FLOAT, handle=handle)


def _inputs(cudnn, graph, layouts: dict, dtypes: dict) -> dict:
    """Graph input tensors: name -> (dims, strides), of dtype ``dtypes[name]`` (e4m3 if not
    named)."""
    return {name: graph.tensor(name=name, dim=dims, stride=strides,
                               data_type=dtypes.get(name, cudnn.data_type.FP8_E4M3))
            for name, (dims, strides) in layouts.items()}


def _outputs(graph_outputs: dict, layouts: dict, dtypes: dict) -> dict:
    """Marks the node's outputs as graph outputs with their dims, strides and dtypes."""
    for name, tensor in graph_outputs.items():
        dims, strides = layouts[name]
        tensor.set_output(True).set_dim(list(dims)).set_stride(list(strides)).set_data_type(
            dtypes[name])
    return graph_outputs


@functools.lru_cache(maxsize=None)
def _forward_plan(device: int, q_layout, k_layout, v_layout, causal: bool,
                  softmax_scale: float) -> _Plan:
    """The forward graph of one problem: q, k, v e4m3 -> O e4m3, statistics, amaxes."""
    torch, cudnn, _ = _load()
    with torch.cuda.device(device):
        graph = _graph(cudnn, _handle(device))
        fp32, e4m3 = cudnn.data_type.FLOAT, cudnn.data_type.FP8_E4M3
        scalars = ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o")
        tensors = _inputs(cudnn, graph, dict(q=q_layout, k=k_layout, v=v_layout,
                                             **{name: _SCALAR for name in scalars}),
                          {name: fp32 for name in scalars})
        out, stats, amax_s, amax_o = graph.sdpa_fp8(
            q=tensors["q"], k=tensors["k"], v=tensors["v"],
            descale_q=tensors["descale_q"], descale_k=tensors["descale_k"],
            descale_v=tensors["descale_v"], descale_s=tensors["descale_s"],
            scale_s=tensors["scale_s"], scale_o=tensors["scale_o"],
            generate_stats=True, attn_scale=softmax_scale, use_causal_mask=causal)
        (b, h, s, d), _ = q_layout
        tensors.update(_outputs(
            dict(o=out, stats=stats, amax_s=amax_s, amax_o=amax_o),
            dict(o=_bhsd((b, s, h, d), (s * h * d, h * d, d, 1)),
                 stats=_stats_layout(b, h, s), amax_s=_SCALAR, amax_o=_SCALAR),
            dict(o=e4m3, stats=fp32, amax_s=fp32, amax_o=fp32)))
        return _finish(cudnn, graph, tensors)


_BACKWARD_SCALARS = ("descale_q", "descale_k", "descale_v", "descale_o", "descale_dO",
                     "descale_s", "descale_dP", "scale_s", "scale_dQ", "scale_dK", "scale_dV",
                     "scale_dP")


@functools.lru_cache(maxsize=None)
def _backward_plan(device: int, q_layout, k_layout, v_layout, o_layout, do_layout, causal: bool,
                   softmax_scale: float, deterministic: bool) -> _Plan:
    """The backward graph of one problem: q, k, v, O, dO e4m3 and the statistics -> dQ, dK, dV
    e4m3 (contiguous, in q's, k's and v's shapes) and four amaxes."""
    torch, cudnn, _ = _load()
    with torch.cuda.device(device):
        graph = _graph(cudnn, _handle(device))
        fp32, e4m3 = cudnn.data_type.FLOAT, cudnn.data_type.FP8_E4M3
        (b, h, s, d), _ = q_layout
        (_, h_kv, s_kv, _), _ = k_layout
        tensors = _inputs(cudnn, graph,
                          dict(q=q_layout, k=k_layout, v=v_layout, o=o_layout, dO=do_layout,
                               stats=_stats_layout(b, h, s),
                               **{name: _SCALAR for name in _BACKWARD_SCALARS}),
                          dict(stats=fp32, **{name: fp32 for name in _BACKWARD_SCALARS}))
        dq, dk, dv, amax_dq, amax_dk, amax_dv, amax_dp = graph.sdpa_fp8_backward(
            **{name: tensors[name] for name in ("q", "k", "v", "o", "dO", "stats",
                                                *_BACKWARD_SCALARS)},
            attn_scale=softmax_scale, use_causal_mask=causal,
            use_deterministic_algorithm=deterministic)
        tensors.update(_outputs(
            dict(dQ=dq, dK=dk, dV=dv, amax_dQ=amax_dq, amax_dK=amax_dk, amax_dV=amax_dv,
                 amax_dP=amax_dp),
            dict(dQ=_bhsd((b, s, h, d), (s * h * d, h * d, d, 1)),
                 dK=_bhsd((b, s_kv, h_kv, d), (s_kv * h_kv * d, h_kv * d, d, 1)),
                 dV=_bhsd((b, s_kv, h_kv, d), (s_kv * h_kv * d, h_kv * d, d, 1)),
                 amax_dQ=_SCALAR, amax_dK=_SCALAR, amax_dV=_SCALAR, amax_dP=_SCALAR),
            dict(dQ=e4m3, dK=e4m3, dV=e4m3, amax_dQ=fp32, amax_dK=fp32, amax_dV=fp32,
                 amax_dP=fp32)))
        return _finish(cudnn, graph, tensors)


@functools.lru_cache(maxsize=None)
def _handle(device: int):
    """One cuDNN handle per device, kept for the process."""
    return load().create_handle()


def _execute(plan: _Plan, device: int, buffers: dict) -> None:
    """Runs ``plan`` on torch's current stream with name -> torch tensor ``buffers``."""
    torch, cudnn, _ = _load()
    if plan.workspace is None:
        plan.workspace = torch.empty(max(plan.workspace_size, 1), dtype=torch.uint8,
                                     device=device)
    handle = _handle(device)
    cudnn.set_stream(handle, torch.cuda.current_stream(device).cuda_stream)
    plan.graph.execute({plan.tensors[name]: x for name, x in buffers.items()}, plan.workspace,
                       handle=handle)


@functools.lru_cache(maxsize=256)
def _constant(device: int, value: float):
    """A number as a float32 (1, 1, 1, 1) tensor on ``device``, made once: a call binding the
    same scales as the last one launches no fill for them (the timed calls of a profile row)."""
    torch = _load()[0]
    return torch.full((1, 1, 1, 1), value, dtype=torch.float32, device=device)


def _scalar(torch, x, device):
    """A descale or scale as the graphs bind it: float32 (1, 1, 1, 1) on ``device`` (a view
    where ``x`` already is one element of float32 there; a number from ``_constant``)."""
    if isinstance(x, torch.Tensor):
        if x.numel() != 1:
            raise ValueError(f"cuDNN's FP8 attention takes one descale per tensor, got shape "
                             f"{tuple(x.shape)}")
        return x.to(device=device, dtype=torch.float32).reshape(1, 1, 1, 1)
    return _constant(device, float(x))


def _check(torch, causal: bool, softmax_scale, **tensors) -> tuple[int, float]:
    """The device index and softmax scale of an e4m3 problem, or the error for its inputs."""
    for name, x in tensors.items():
        if not isinstance(x, torch.Tensor) or x.dtype != torch.float8_e4m3fn or not x.is_cuda:
            raise TypeError(f"{name} must be a float8_e4m3fn CUDA tensor, got "
                            f"{getattr(x, 'dtype', type(x).__name__)}")
        if x.dim() != 4 or x.stride(3) != 1:
            raise ValueError(f"{name} must be (batch, seqlen, heads, head_dim) with unit stride "
                             f"in head_dim, got shape {tuple(x.shape)}, strides {x.stride()}")
    q, k = tensors["q8"], tensors["k8"]
    if causal and q.shape[1] != k.shape[1]:
        raise CudnnUnsupported(f"causal with seqlen_q {q.shape[1]} != seqlen_k {k.shape[1]}: "
                               "cuDNN's FP8 top-left mask is ptxattn's bottom-right one only "
                               "for equal lengths")
    scale = 1.0 / math.sqrt(q.shape[3]) if softmax_scale is None else float(softmax_scale)
    return q.device.index, scale


def _layout(x) -> tuple[tuple, tuple]:
    return _bhsd(tuple(x.shape), tuple(x.stride()))


def forward(q8, k8, v8, *, q_descale, k_descale, v_descale, causal: bool = False,
            softmax_scale: float | None = None) -> Fp8Forward:
    """cuDNN's FP8 attention forward (``sdpa_fp8``) on torch's current stream.

    Parameters
    ----------
    q8 : torch.Tensor
        float8_e4m3fn (batch, seqlen_q, heads_q, head_dim), unit stride in head_dim.
    k8, v8 : torch.Tensor
        float8_e4m3fn (batch, seqlen_k, heads_kv, head_dim), heads_q a multiple of heads_kv.
    q_descale, k_descale, v_descale : float or torch.Tensor
        One descale each (a number or a one-element float tensor).
    causal : bool, default False
        The causal mask; seqlen_q must then equal seqlen_k (module docstring).
    softmax_scale : float, optional
        1 / sqrt(head_dim) by default.

    Returns
    -------
    Fp8Forward
        The e4m3 output, its descale (2 v_descale), the log-sum-exp and cuDNN's amaxes.

    Raises
    ------
    CudnnUnavailable
        torch, CUDA, cudnn-frontend or libcudnn missing.
    CudnnUnsupported
        cuDNN declines the graph, or causal with unequal lengths.
    TypeError, ValueError
        An input not float8_e4m3fn on CUDA, not 4-d with unit stride in head_dim, or a descale
        of more than one element.
    """
    torch = _load()[0]
    device, scale = _check(torch, causal, softmax_scale, q8=q8, k8=k8, v8=v8)
    plan = _forward_plan(device, _layout(q8), _layout(k8), _layout(v8), bool(causal), scale)
    batch, seqlen, heads, head_dim = q8.shape
    v_descale = _scalar(torch, v_descale, device)
    # |O| <= max |v| <= 448 v_descale; the 2 covers P's e4m3 rounding (module docstring)
    out_descale = 2 * v_descale
    out = torch.empty((batch, seqlen, heads, head_dim), dtype=torch.float8_e4m3fn,
                      device=device)
    stats = torch.empty((batch, heads, seqlen, 1), dtype=torch.float32, device=device)
    amax_p, amax_out = (torch.empty((1, 1, 1, 1), dtype=torch.float32, device=device)
                        for _ in range(2))
    _execute(plan, device, dict(
        q=q8, k=k8, v=v8, descale_q=_scalar(torch, q_descale, device),
        descale_k=_scalar(torch, k_descale, device), descale_v=v_descale,
        descale_s=_scalar(torch, 1 / P_SCALE, device), scale_s=_scalar(torch, P_SCALE, device),
        scale_o=1 / out_descale, o=out, stats=stats, amax_s=amax_p, amax_o=amax_out))
    return Fp8Forward(out, out_descale, stats.reshape(batch, heads, seqlen), amax_out, amax_p)


def backward(dout8, q8, k8, v8, out8, lse, *, q_descale, k_descale, v_descale, out_descale,
             dout_descale, causal: bool = False, softmax_scale: float | None = None,
             deterministic: bool = False, scales: GradScales | None = None) -> Fp8Backward:
    """cuDNN's FP8 attention backward (``sdpa_fp8_backward``) on torch's current stream.

    Parameters
    ----------
    dout8 : torch.Tensor
        float8_e4m3fn, the output's gradient, out8's shape.
    q8, k8, v8 : torch.Tensor
        As ``forward`` took them.
    out8 : torch.Tensor
        float8_e4m3fn (batch, seqlen_q, heads_q, head_dim): ``Fp8Forward.out``.
    lse : torch.Tensor
        float32 (batch, heads_q, seqlen_q), contiguous: ``Fp8Forward.lse``.
    q_descale, k_descale, v_descale, out_descale, dout_descale : float or torch.Tensor
        One descale each; out_descale is ``Fp8Forward.out_descale``.
    causal : bool, default False
        As in the forward.
    softmax_scale : float, optional
        1 / sqrt(head_dim) by default.
    deterministic : bool, default False
        cuDNN's deterministic algorithm.
    scales : GradScales, optional
        The gradients' scales; without them the call calibrates them first (two extra calls,
        module docstring).

    Returns
    -------
    Fp8Backward
        dq, dk, dv in e4m3 with their descales, the scales used and cuDNN's amaxes.

    Raises
    ------
    CudnnUnavailable
        torch, CUDA, cudnn-frontend or libcudnn missing.
    CudnnUnsupported
        cuDNN declines the graph (on Hopper any head_dim but 128), or causal with unequal
        lengths.
    TypeError, ValueError
        As ``forward``; lse not float32 (batch, heads_q, seqlen_q) contiguous.
    """
    torch = _load()[0]
    device, scale = _check(torch, causal, softmax_scale, q8=q8, k8=k8, v8=v8, out8=out8,
                           dout8=dout8)
    batch, seqlen, heads, _ = q8.shape
    if (lse.dtype != torch.float32 or tuple(lse.shape) != (batch, heads, seqlen)
            or not lse.is_contiguous()):
        raise ValueError(f"lse must be float32 ({batch}, {heads}, {seqlen}), contiguous, got "
                         f"{lse.dtype} {tuple(lse.shape)}")
    plan = _backward_plan(device, _layout(q8), _layout(k8), _layout(v8), _layout(out8),
                          _layout(dout8), bool(causal), scale, bool(deterministic))
    inputs = dict(q=q8, k=k8, v=v8, o=out8, dO=dout8, stats=lse.reshape(batch, heads, seqlen, 1),
                  descale_q=_scalar(torch, q_descale, device),
                  descale_k=_scalar(torch, k_descale, device),
                  descale_v=_scalar(torch, v_descale, device),
                  descale_o=_scalar(torch, out_descale, device),
                  descale_dO=_scalar(torch, dout_descale, device),
                  descale_s=_scalar(torch, 1 / P_SCALE, device),
                  scale_s=_scalar(torch, P_SCALE, device))

    def run(grad_scales: GradScales) -> Fp8Backward:
        dq, dk, dv = (torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=device)
                      for x in (q8, k8, v8))
        amax = {name: torch.empty((1, 1, 1, 1), dtype=torch.float32, device=device)
                for name in ("dp", "dq", "dk", "dv")}
        _execute(plan, device, dict(
            inputs, dQ=dq, dK=dk, dV=dv, amax_dP=amax["dp"], amax_dQ=amax["dq"],
            amax_dK=amax["dk"], amax_dV=amax["dv"],
            descale_dP=_scalar(torch, 1 / grad_scales.dp, device),
            scale_dP=_scalar(torch, grad_scales.dp, device),
            scale_dQ=_scalar(torch, grad_scales.dq, device),
            scale_dK=_scalar(torch, grad_scales.dk, device),
            scale_dV=_scalar(torch, grad_scales.dv, device)))
        return Fp8Backward(dq, dk, dv, *(_scalar(torch, 1 / s, device) for s in (
            grad_scales.dq, grad_scales.dk, grad_scales.dv)), grad_scales, amax)

    if scales is None:
        # dS's amax depends on no gradient scale, dQ's and dK's on dS's scale alone
        first = run(GradScales())
        dp_dv = dict(dp=first.amax["dp"].item(), dv=first.amax["dv"].item())
        second = run(GradScales.from_amax(**dp_dv))
        scales = GradScales.from_amax(**dp_dv, dq=second.amax["dq"].item(),
                                      dk=second.amax["dk"].item())
    return run(scales)
