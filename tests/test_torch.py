"""ptxattn.torch: the custom ops, their fakes, autograd, torch.compile.

CPU (fake and meta tensors, no GPU): the fakes give the real ops' shapes, dtypes and strides
(dsinks too, of shape (0,) without sinks), autograd reaches the backward ops (the sinks' gradient
with it), torch.library.opcheck accepts every op's registration, and torch.compile traces
forward and backward with fullgraph=True, with and without a window, a softcap and sinks, fixed
length and varlen. The KV-cache op: the same forward checks, its schema naming k_cache and
v_cache as mutated, and a gradient through it raising (it has no backward), eagerly and under
torch.compile. With v narrower than q and k (head_dim_v < head_dim, and head dims between the
compiled ones), every fake gives the output v's head_dim and the gradients their inputs' shapes,
opcheck accepts every op and torch.compile traces forward and backward. Every Python function
refuses a CPU tensor, a tensor of another dtype or no tensor with a TypeError naming the
argument, before any op is entered.

GPU: values and gradients against torch SDPA and against FP32 attention, bf16, causal or not,
GQA. Tolerance, the rule of tests/test_attention.py and tests/test_backward.py (whose checks are
reused): against the FP32 reference (ptxattn.reference), each result's max error is at most
twice the max error of the same math done naively in bf16, plus twice the rounding noise of one
bf16 value. Against SDPA the same bound holds for the difference: both are fused kernels that
accumulate in FP32 and round far less than the naive computation, each at most about the naive
error away from FP32, so at most about twice that from each other. With a window, a softcap or
sinks, fixed length or varlen (per sequence), out, dq, dk, dv and dsinks are held by the same
rule to torch autograd through the math written in torch ops (_reference_attention): in FP32
the truth, in the input dtype the naive computation; so are they with a narrower v and with
head dims between the compiled ones. The serving ops give, bit for bit, what
ptxattn's CuPy entry points give (tests/test_serving.py holds those to FP32), append k_new/v_new
into the caller's caches, eagerly and under torch.compile (inductor, fullgraph), and pass
opcheck with the real kernels; the varlen op's gradients under torch.compile are eager's.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")

import ptxattn.torch  # noqa: E402  after the skip: it imports torch

SHAPES = {"mha": ((2, 300, 8, 128), (2, 200, 8, 128)), "gqa": ((2, 300, 8, 64), (2, 200, 2, 64))}


# The options beyond causal attention, "sinks" standing for a float32 (heads_q,) tensor of them
MASKS = {"plain": {}, "window-softcap-sinks": {"window": (64, 0), "softcap": 20.0, "sinks": True}}


def _sinks(heads_q, device, rng=None, requires_grad=False):
    """float32 (heads_q,) sink logits: zeros (on meta or fake devices, where values do not
    matter), or values drawn from ``rng`` uniformly in [1, 5], so that every sink takes a share
    of its rows that its gradient's error is measured on (a sink far below the scores has a
    gradient of about 0, whose error against the naive run's is a ratio of roundings)."""
    if rng is None:
        x = torch.zeros(heads_q, dtype=torch.float32, device=device)
    else:
        x = torch.tensor(rng.uniform(1, 5, heads_q).astype(np.float32), device=device)
    return x.requires_grad_(requires_grad)


def _split_sinks(masks, heads_q, device, rng=None, requires_grad=False):
    """``masks`` without its "sinks" flag, and the sinks tensor the flag asks for (or None)."""
    options = dict(masks)
    wanted = options.pop("sinks", False)
    return options, (_sinks(heads_q, device, rng, requires_grad) if wanted else None)


def _fwd_args(q, k, v, deterministic=False, window=(-1, -1), softcap=0.0, sinks=None):
    """attention_fwd's arguments: causal, default scale, default backend."""
    return (q, k, v, True, None, window, softcap, sinks, deterministic, None)


def _bwd_args(dout, q, k, v, out, lse, deterministic=False, window=(-1, -1), softcap=0.0,
              sinks=None):
    """attention_bwd's arguments, the options as _fwd_args gives them."""
    return (dout, q, k, v, out, lse, True, None, window, softcap, sinks, deterministic, None)


@pytest.mark.parametrize("masks", MASKS.values(), ids=MASKS)
@pytest.mark.parametrize("kind", SHAPES)
def test_fake_forward_has_the_real_shapes_dtypes_and_strides(kind, masks):
    from torch._subclasses.fake_tensor import FakeTensorMode

    shape_q, shape_kv = SHAPES[kind]
    with FakeTensorMode():
        q = torch.empty(shape_q, dtype=torch.bfloat16, device="cuda")
        k = v = torch.empty(shape_kv, dtype=torch.bfloat16, device="cuda")
        options, sinks = _split_sinks(masks, shape_q[2], "cuda")
        out, lse = ptxattn.torch.attention(q, k, v, causal=True, sinks=sinks, return_lse=True,
                                           **options)
        dq, dk, dv, dsinks = torch.ops.ptxattn.attention_bwd(
            *_bwd_args(out, q, k, v, out, lse, sinks=sinks, **options))
    assert (out.shape, out.dtype, out.device.type) == (q.shape, torch.bfloat16, "cuda")
    assert out.is_contiguous() and lse.is_contiguous()
    assert (lse.shape, lse.dtype) == ((shape_q[0], shape_q[2], shape_q[1]), torch.float32)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    assert dq.dtype == dk.dtype == dv.dtype == torch.bfloat16
    # the sinks' gradient, or the (0,) stand-in for a call without sinks
    assert (dsinks.shape, dsinks.dtype) == ((shape_q[2] if sinks is not None else 0,),
                                            torch.float32)


def _meta_leaves(kind, masks=None):
    """q, k, v on the meta device that require grad, and the sinks ``masks`` asks for (also
    requiring grad), with the other options of ``masks``."""
    shape_q, shape_kv = SHAPES[kind]
    leaves = [torch.empty(shape, dtype=torch.bfloat16, device="meta", requires_grad=True)
              for shape in (shape_q, shape_kv, shape_kv)]
    options, sinks = _split_sinks(masks or {}, shape_q[2], "meta", requires_grad=True)
    return leaves, sinks, options


def _assert_backward_reaches_the_leaves(out, lse, leaves, sinks):
    """out takes a gradient and lse none; out.sum()'s backward gives every leaf a gradient of
    its shape (bf16 for q, k, v; float32 for the sinks)."""
    assert out.requires_grad and not lse.requires_grad  # lse carries no gradient
    out.sum().backward()
    for leaf in leaves:
        assert leaf.grad.shape == leaf.shape and leaf.grad.dtype == torch.bfloat16
    if sinks is not None:
        assert (sinks.grad.shape, sinks.grad.dtype) == (sinks.shape, torch.float32)


@pytest.mark.parametrize("masks", MASKS.values(), ids=MASKS)
@pytest.mark.parametrize("kind", SHAPES)
def test_autograd_reaches_the_backward_op(kind, masks):
    (q, k, v), sinks, options = _meta_leaves(kind, masks)
    out, lse = ptxattn.torch.attention(q, k, v, causal=True, sinks=sinks, return_lse=True,
                                       **options)
    _assert_backward_reaches_the_leaves(out, lse, (q, k, v), sinks)


@pytest.mark.parametrize("masks", MASKS.values(), ids=MASKS)
@pytest.mark.parametrize("kind", SHAPES)
def test_opcheck_on_meta_tensors(kind, masks):
    """Schema (no input mutated), autograd registration, fake against the meta kernel, and AOT
    dispatch with dynamic shapes: the registrations' checks, which need no GPU."""
    (q, k, v), sinks, options = _meta_leaves(kind, masks)
    torch.library.opcheck(torch.ops.ptxattn.attention_fwd.default,
                          _fwd_args(q, k, v, sinks=sinks, **options))
    q, k, v = (x.detach() for x in (q, k, v))
    sinks = None if sinks is None else sinks.detach()
    out, lse = torch.ops.ptxattn.attention_fwd(*_fwd_args(q, k, v, sinks=sinks, **options))
    torch.library.opcheck(torch.ops.ptxattn.attention_bwd.default,
                          _bwd_args(out, q, k, v, out, lse, sinks=sinks, **options))


@pytest.mark.parametrize("masks", MASKS.values(), ids=MASKS)
def test_compile_traces_forward_and_backward_in_one_graph(masks):
    """fullgraph=True fails on any graph break; aot_eager runs the traced forward and backward
    graphs, here on meta tensors, so through the fakes."""
    (q, k, v), sinks, options = _meta_leaves("gqa", masks)

    @torch.compile(backend="aot_eager", fullgraph=True)
    def loss(q, k, v, sinks):
        out = ptxattn.torch.attention(q, k, v, causal=True, sinks=sinks, **options)
        return out.float().square().mean()

    loss(q, k, v, sinks).backward()
    assert q.grad.shape == q.shape and v.grad.shape == v.shape
    if sinks is not None:
        assert sinks.grad.shape == sinks.shape


# ---------------------------------------------------------------------------------------------
# The serving ops on fake and meta tensors

# varlen: three sequences of 5, 0 and 11 queries over 7, 3 and 20 keys, GQA 8/2, head_dim 128
VARLEN = {"lengths_q": [5, 0, 11], "lengths_k": [7, 3, 20], "heads": (8, 2), "head_dim": 128}
VARLEN_MASKS = {"causal": {}, "window-softcap-sinks": {"causal": False, "window": (6, 2),
                                                       "softcap": 20.0, "sinks": True}}
# kvcache: batch 3, 2 new queries and 2 new keys a sequence, a paged cache of 10 pages of 16
KVCACHE = {"batch": 3, "seqlen_q": 2, "heads": (8, 2), "head_dim": 128, "pages": (10, 16),
           "block_table": [[5, 0, 3], [1, 9, 4], [8, 2, 6]]}


def _bf16(shape, device, rng, requires_grad):
    """Zeros (on meta or fake devices, where values do not matter), or standard normal values
    drawn from ``rng``."""
    if rng is None:
        x = torch.zeros(shape, dtype=torch.bfloat16, device=device)
    else:
        x = _normal(rng, shape)[0]
    return x.requires_grad_(requires_grad)


def _varlen_args(device, requires_grad=False, rng=None, causal=True, window=(-1, -1),
                 softcap=0.0, sinks=None, deterministic=False, head_dims=None):
    """attention_varlen_fwd's arguments on ``device`` (default scale, contents checked, default
    backend); ``head_dims`` (head_dim, head_dim_v), VARLEN's head_dim for both by default."""
    heads_q, heads_kv = VARLEN["heads"]
    d, d_v = head_dims or (VARLEN["head_dim"],) * 2
    total_q, total_k = sum(VARLEN["lengths_q"]), sum(VARLEN["lengths_k"])
    q = _bf16((total_q, heads_q, d), device, rng, requires_grad)
    k = _bf16((total_k, heads_kv, d), device, rng, requires_grad)
    v = _bf16((total_k, heads_kv, d_v), device, rng, requires_grad)
    cu_q, cu_k = (torch.tensor(np.cumsum([0] + VARLEN[name]), dtype=torch.int32, device=device)
                  for name in ("lengths_q", "lengths_k"))
    return (q, k, v, cu_q, cu_k, max(VARLEN["lengths_q"]), max(VARLEN["lengths_k"]), causal,
            None, window, softcap, sinks, deterministic, True, None)


def _varlen_case(device, masks, requires_grad=False, rng=None, deterministic=False):
    """_varlen_args with the options of ``masks`` (an entry of VARLEN_MASKS), its sinks
    requiring grad with q, k and v."""
    options, sinks = _split_sinks(masks, VARLEN["heads"][0], device, rng, requires_grad)
    return _varlen_args(device, requires_grad, rng, sinks=sinks, deterministic=deterministic,
                        **options)


def _varlen_bwd_args(fwd_args, out, lse):
    """attention_varlen_bwd's arguments for the attention_varlen_fwd call on ``fwd_args`` that
    gave ``out`` and ``lse``, with out for dout."""
    q, k, v, *options = fwd_args
    return (out, q, k, v, out, lse, *options)


def _kvcache_args(device, requires_grad=False, rng=None, cache_seqlens=(3, 0, 40),
                  head_dims=None):
    """attention_with_kvcache_fwd's arguments on ``device``: a paged cache whose block_table
    gives each sequence 3 of the 10 pages, in no order, k_new/v_new appended at
    ``cache_seqlens`` (a tuple: a tensor of lengths; an int: one length for all), causal;
    ``head_dims`` (head_dim, head_dim_v), KVCACHE's head_dim for both by default."""
    batch, seqlen_q = KVCACHE["batch"], KVCACHE["seqlen_q"]
    heads_q, heads_kv = KVCACHE["heads"]
    d, d_v = head_dims or (KVCACHE["head_dim"],) * 2
    num_pages, page_size = KVCACHE["pages"]
    q = _bf16((batch, seqlen_q, heads_q, d), device, rng, requires_grad)
    k_cache, v_cache = (_bf16((num_pages, page_size, heads_kv, dim), device, rng, False)
                        for dim in (d, d_v))
    k_new, v_new = (_bf16((batch, seqlen_q, heads_kv, dim), device, rng, requires_grad)
                    for dim in (d, d_v))
    table = torch.tensor(KVCACHE["block_table"], dtype=torch.int32, device=device)
    lengths, uniform = ((torch.tensor(cache_seqlens, dtype=torch.int32, device=device), 0)
                        if isinstance(cache_seqlens, tuple) else (None, cache_seqlens))
    return (q, k_cache, v_cache, lengths, uniform, table, k_new, v_new, True, (-1, -1), 0.0,
            None, None, 0, True, None, None, None)


# MLA: batch 2, one new query and latent row a sequence over a paged latent cache of 6 pages of
# 16 rows, 16 heads
MLA = {"batch": 2, "heads": 16, "pages": (6, 16), "block_table": [[4, 0, 2], [1, 5, 3]]}


def _mla_args(device, fp8=False, rng=None):
    """attention_mla_decode_fwd's arguments on ``device``: (q, kv_cache, cache_seqlens,
    uniform_cache_seqlen, block_table, kv_new, kv_descale, softmax_scale, causal, num_splits,
    check_contents); an e4m3 cache with a per-tensor descale if ``fp8``."""
    batch, heads = MLA["batch"], MLA["heads"]
    num_pages, page_size = MLA["pages"]
    q = _bf16((batch, 1, heads, 576), device, rng, False)
    kv_cache = _bf16((num_pages, page_size, 1, 576), device, rng, False)
    kv_new = _bf16((batch, 1, 1, 576), device, rng, False)
    descale = None
    if fp8:
        kv_cache = (kv_cache / 8).to(torch.float8_e4m3fn)
        descale = torch.full((1,), 0.125, dtype=torch.float32, device=device)
    table = torch.tensor(MLA["block_table"], dtype=torch.int32, device=device)
    lengths = torch.tensor([20, 0], dtype=torch.int32, device=device)
    return (q, kv_cache, lengths, 0, table, kv_new, descale, None, True, 0, True)


def test_fake_serving_ops_have_the_real_shapes_dtypes_and_strides():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q, k, v, cu_q, cu_k, max_q, max_k, *_ = _varlen_args("cuda")
        out, lse = ptxattn.torch.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k,
                                                  causal=True, return_lse=True)
        assert (out.shape, out.dtype, out.device.type) == (q.shape, torch.bfloat16, "cuda")
        assert (lse.shape, lse.dtype) == ((q.shape[1], q.shape[0]), torch.float32)
        assert out.is_contiguous() and lse.is_contiguous()

        q, k_cache, v_cache, lengths, _, table, k_new, v_new, *_ = _kvcache_args("cuda")
        for cache_seqlens in (lengths, 7):
            out, lse = ptxattn.torch.attention_with_kvcache(
                q, k_cache, v_cache, cache_seqlens=cache_seqlens, block_table=table, k_new=k_new,
                v_new=v_new, return_lse=True)
            assert (out.shape, out.dtype) == (q.shape, torch.bfloat16)
            assert (lse.shape, lse.dtype) == ((3, 8, 2), torch.float32)
            assert out.is_contiguous() and lse.is_contiguous()


def test_kvcache_op_declares_the_caches_mutated():
    schema = torch.ops.ptxattn.attention_with_kvcache_fwd.default._schema
    mutated = [a.name for a in schema.arguments if a.alias_info and a.alias_info.is_write]
    assert mutated == ["k_cache", "v_cache"]
    schema = torch.ops.ptxattn.attention_mla_decode_fwd.default._schema
    assert [a.name for a in schema.arguments if a.alias_info and a.alias_info.is_write] == [
        "kv_cache"]
    for op in ("attention_varlen_fwd", "attention_varlen_bwd"):
        schema = getattr(torch.ops.ptxattn, op).default._schema
        assert not any(a.alias_info for a in schema.arguments), op


def test_opcheck_kvcache_op_on_meta_tensors():
    """Schema (only the caches mutated), autograd (none registered: torch's), fake against the
    meta kernel, AOT dispatch with dynamic shapes."""
    torch.library.opcheck(torch.ops.ptxattn.attention_with_kvcache_fwd.default,
                          _kvcache_args("meta"))


def test_opcheck_kvcache_op_with_e4m3_caches_on_meta_tensors():
    args = list(_kvcache_args("meta"))
    args[1], args[2] = (cache.to(torch.float8_e4m3fn) for cache in args[1:3])
    args[-2:] = [torch.ones((1,), dtype=torch.float32, device="meta")] * 2
    torch.library.opcheck(torch.ops.ptxattn.attention_with_kvcache_fwd.default, tuple(args))


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "e4m3"])
def test_opcheck_mla_op_on_meta_tensors(fp8):
    torch.library.opcheck(torch.ops.ptxattn.attention_mla_decode_fwd.default,
                          _mla_args("meta", fp8))


@pytest.mark.filterwarnings("ignore:Error detected in GeneratedBackward")  # anomaly mode's
def test_a_gradient_through_the_mla_op_raises():
    args = list(_mla_args("meta"))
    args[0] = args[0].requires_grad_()
    out, _ = torch.ops.ptxattn.attention_mla_decode_fwd(*args)
    assert out.requires_grad
    with pytest.raises(RuntimeError, match="ptxattn.attention_mla_decode_fwd.* no autograd "
                                           "formula"):
        out.sum().backward()


def test_fake_mla_op_has_the_real_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q, kv_cache, lengths, _, table, kv_new, *_ = _mla_args("cuda")
        out, lse = ptxattn.torch.attention_mla_decode(q, kv_cache, cache_seqlens=lengths,
                                                      block_table=table, kv_new=kv_new,
                                                      return_lse=True)
        assert (out.shape, out.dtype) == ((2, 1, 16, 512), torch.bfloat16)
        assert (lse.shape, lse.dtype) == ((2, 16, 1), torch.float32)


def test_mla_wrapper_names_a_cpu_or_misdtyped_tensor():
    q, kv_cache, lengths, _, table, kv_new, *_ = _mla_args("meta")
    with pytest.raises(TypeError, match="kv_cache must be a CUDA tensor"):
        ptxattn.torch.attention_mla_decode(q, torch.zeros(6, 16, 1, 576), cache_seqlens=lengths)
    with pytest.raises(TypeError, match="kv_descale must have dtype float32"):
        ptxattn.torch.attention_mla_decode(q, kv_cache, cache_seqlens=lengths,
                                           kv_descale=lengths)


@pytest.mark.filterwarnings("ignore:Error detected in GeneratedBackward")  # anomaly mode's
def test_a_gradient_through_the_kvcache_op_raises():
    """No backward yet: the forward runs on tensors that require grad, a backward through it
    raises rather than giving zeros."""
    call = torch.ops.ptxattn.attention_with_kvcache_fwd
    out, lse = call(*_kvcache_args("meta", requires_grad=True))
    assert out.requires_grad
    with pytest.raises(RuntimeError, match="ptxattn.attention_with_kvcache_fwd.* no autograd "
                                           "formula"):
        out.sum().backward()
    # torch.compile traces the backward with the forward: there it fails when compiling
    with pytest.raises(Exception, match="no autograd formula"):
        torch.compile(lambda *a: call(*a)[0].sum(), backend="aot_eager", fullgraph=True)(
            *_kvcache_args("meta", requires_grad=True))


@pytest.mark.parametrize("masks", VARLEN_MASKS.values(), ids=VARLEN_MASKS)
def test_varlen_autograd_reaches_the_backward_op(masks):
    q, k, v, cu_q, cu_k, max_q, max_k, causal, _, window, softcap, sinks, *_ = _varlen_case(
        "meta", masks, requires_grad=True)
    out, lse = ptxattn.torch.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal,
                                              window=window, softcap=softcap, sinks=sinks,
                                              return_lse=True)
    _assert_backward_reaches_the_leaves(out, lse, (q, k, v), sinks)


@pytest.mark.parametrize("masks", VARLEN_MASKS.values(), ids=VARLEN_MASKS)
def test_opcheck_varlen_ops_on_meta_tensors(masks):
    """Schema (nothing mutated), autograd registration (the forward's, on inputs that require
    grad), fake against the meta kernel, AOT dispatch with dynamic shapes, for both ops."""
    args = _varlen_case("meta", masks, requires_grad=True)
    torch.library.opcheck(torch.ops.ptxattn.attention_varlen_fwd.default, args)
    args = tuple(x.detach() if isinstance(x, torch.Tensor) else x for x in args)
    out, lse = torch.ops.ptxattn.attention_varlen_fwd(*args)
    torch.library.opcheck(torch.ops.ptxattn.attention_varlen_bwd.default,
                          _varlen_bwd_args(args, out, lse))


def test_compile_traces_varlen_forward_and_backward_in_one_graph():
    """fullgraph=True fails on any graph break; aot_eager runs the traced forward and backward
    graphs on meta tensors, through the fakes, the sinks' gradient among them."""
    q, k, v, cu_q, cu_k, max_q, max_k, causal, _, window, softcap, sinks, *_ = _varlen_case(
        "meta", VARLEN_MASKS["window-softcap-sinks"], requires_grad=True)

    @torch.compile(backend="aot_eager", fullgraph=True)
    def loss(q, k, v, sinks):
        out = ptxattn.torch.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal,
                                             window=window, softcap=softcap, sinks=sinks)
        return out.float().square().mean()

    loss(q, k, v, sinks).backward()
    for leaf in (q, k, v, sinks):
        assert leaf.grad.shape == leaf.shape


def test_compile_traces_the_serving_ops_in_one_graph():
    """fullgraph=True fails on a graph break; aot_eager runs the functionalized graph (the cache
    mutation as auto_functionalized) on meta tensors, through the fakes."""
    @torch.compile(backend="aot_eager", fullgraph=True)
    def step(varlen, kvcache, uniform_seqlen):
        q, k, v, cu_q, cu_k, max_q, max_k, *_ = varlen
        packed = ptxattn.torch.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=True)
        q, k_cache, v_cache, _, _, table, k_new, v_new, *_ = kvcache
        decoded = ptxattn.torch.attention_with_kvcache(
            q, k_cache, v_cache, cache_seqlens=uniform_seqlen, block_table=table, k_new=k_new,
            v_new=v_new, window=(64, 0), softcap=30.0)
        return packed.float().sum() + decoded.float().sum()

    assert step(_varlen_args("meta"), _kvcache_args("meta"), 5).shape == ()


# ---------------------------------------------------------------------------------------------
# Head dims between the compiled ones, and values narrower than the queries and keys: the
# output has v's head_dim (head_dim_v), the gradients their inputs' shapes

# name -> (head_dim, head_dim_v): multi-head latent attention's 192/128, a narrower v between
# compiled head dims, and one head_dim between them for all three
HEAD_DIMS = {"192-128": (192, 128), "96-64": (96, 64), "80": (80, 80)}


def _leaves(head_dims, device="meta", requires_grad=True, rng=None):
    """q (2, 300, 8, head_dim), k (2, 200, 2, head_dim) and v (2, 200, 2, head_dim_v)."""
    head_dim, head_dim_v = head_dims
    return [_bf16(shape, device, rng, requires_grad)
            for shape in ((2, 300, 8, head_dim), (2, 200, 2, head_dim),
                          (2, 200, 2, head_dim_v))]


@pytest.mark.parametrize("head_dims", HEAD_DIMS.values(), ids=HEAD_DIMS)
def test_fakes_give_the_output_vs_head_dim(head_dims):
    from torch._subclasses.fake_tensor import FakeTensorMode

    head_dim_v = head_dims[1]
    with FakeTensorMode():
        q, k, v = _leaves(head_dims, "cuda", requires_grad=False)
        out, lse = ptxattn.torch.attention(q, k, v, causal=True, return_lse=True)
        assert (out.shape, out.dtype) == ((2, 300, 8, head_dim_v), torch.bfloat16)
        assert out.is_contiguous() and lse.shape == (2, 8, 300)
        dq, dk, dv, _ = torch.ops.ptxattn.attention_bwd(*_bwd_args(out, q, k, v, out, lse))
        assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)

        args = _varlen_args("cuda", head_dims=head_dims)
        q, k, v = args[:3]
        out, lse = torch.ops.ptxattn.attention_varlen_fwd(*args)
        assert (out.shape, out.dtype) == ((q.shape[0], 8, head_dim_v), torch.bfloat16)
        assert out.is_contiguous() and lse.shape == (8, q.shape[0])
        dq, dk, dv, _ = torch.ops.ptxattn.attention_varlen_bwd(*_varlen_bwd_args(args, out, lse))
        assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)

        q, k_cache, v_cache, lengths, _, table, k_new, v_new, *_ = _kvcache_args(
            "cuda", head_dims=head_dims)
        out, lse = ptxattn.torch.attention_with_kvcache(
            q, k_cache, v_cache, cache_seqlens=lengths, block_table=table, k_new=k_new,
            v_new=v_new, return_lse=True)
        assert (out.shape, out.dtype) == ((3, 2, 8, head_dim_v), torch.bfloat16)
        assert out.is_contiguous() and lse.shape == (3, 8, 2)


@pytest.mark.parametrize("head_dims", HEAD_DIMS.values(), ids=HEAD_DIMS)
def test_opcheck_with_narrower_values_on_meta_tensors(head_dims):
    """Every op's registrations, as in test_opcheck_on_meta_tensors, with v of head_dim_v."""
    q, k, v = _leaves(head_dims)
    torch.library.opcheck(torch.ops.ptxattn.attention_fwd.default, _fwd_args(q, k, v))
    q, k, v = (x.detach() for x in (q, k, v))
    out, lse = torch.ops.ptxattn.attention_fwd(*_fwd_args(q, k, v))
    torch.library.opcheck(torch.ops.ptxattn.attention_bwd.default,
                          _bwd_args(out, q, k, v, out, lse))
    args = _varlen_args("meta", requires_grad=True, head_dims=head_dims)
    torch.library.opcheck(torch.ops.ptxattn.attention_varlen_fwd.default, args)
    args = tuple(x.detach() if isinstance(x, torch.Tensor) else x for x in args)
    out, lse = torch.ops.ptxattn.attention_varlen_fwd(*args)
    torch.library.opcheck(torch.ops.ptxattn.attention_varlen_bwd.default,
                          _varlen_bwd_args(args, out, lse))
    torch.library.opcheck(torch.ops.ptxattn.attention_with_kvcache_fwd.default,
                          _kvcache_args("meta", head_dims=head_dims))


@pytest.mark.parametrize("head_dims", HEAD_DIMS.values(), ids=HEAD_DIMS)
def test_compile_traces_narrower_values_forward_and_backward(head_dims):
    """fullgraph, aot_eager on meta tensors: a loss over the fixed-length and the varlen op with
    v of head_dim_v, each gradient of its input's shape."""
    q, k, v = _leaves(head_dims)
    varlen_q, varlen_k, varlen_v, cu_q, cu_k, max_q, max_k, *_ = _varlen_args(
        "meta", requires_grad=True, head_dims=head_dims)

    @torch.compile(backend="aot_eager", fullgraph=True)
    def loss(q, k, v, varlen_q, varlen_k, varlen_v):
        out = ptxattn.torch.attention(q, k, v, causal=True)
        packed = ptxattn.torch.attention_varlen(varlen_q, varlen_k, varlen_v, cu_q, cu_k,
                                                max_q, max_k, causal=True)
        return out.float().square().mean() + packed.float().square().mean()

    leaves = (q, k, v, varlen_q, varlen_k, varlen_v)
    loss(*leaves).backward()
    for leaf in leaves:
        assert leaf.grad.shape == leaf.shape


# ---------------------------------------------------------------------------------------------
# Argument checks before the ops: a TypeError naming the argument, not the dispatcher's error


def _bf16_zeros(*shape, device="meta", dtype=torch.bfloat16):
    return torch.zeros(shape, dtype=dtype, device=device)


def _on_cpu(x):
    """Zeros like the meta tensor ``x``, on the CPU (a meta tensor has no data to copy)."""
    return torch.zeros_like(x, device="cpu")


@pytest.mark.parametrize("q, message", [
    (torch.zeros((1, 128, 2, 64), dtype=torch.bfloat16, device="cpu"),
     r"q must be a CUDA tensor \(ptxattn's kernels run on the GPU\), got a tensor on cpu"),
    (torch.zeros((1, 128, 2, 64), dtype=torch.float32, device="meta"),
     "q must have dtype float16 or bfloat16, got torch.float32"),
    (np.zeros((1, 128, 2, 64), dtype=np.float16), "q must be a torch.Tensor on a CUDA device"),
], ids=["cpu", "float32", "numpy"])
def test_attention_refuses_a_cpu_tensor_or_another_dtype_by_name(q, message):
    k = v = _bf16_zeros(1, 128, 2, 64)
    with pytest.raises(TypeError, match=message):
        ptxattn.torch.attention(q, k, v)
    with pytest.raises(TypeError, match=message):
        ptxattn.torch.ring_attention(q, k, v, group=None)


def test_attention_names_k_and_v_on_the_cpu():
    q = _bf16_zeros(1, 128, 2, 64)
    cpu = _bf16_zeros(1, 128, 2, 64, device="cpu")
    with pytest.raises(TypeError, match="k must be a CUDA tensor"):
        ptxattn.torch.attention(q, cpu, q)
    with pytest.raises(TypeError, match="v must be a CUDA tensor"):
        ptxattn.torch.attention(q, q, cpu)


def test_serving_functions_check_their_tensors_before_the_ops():
    q, k, v, cu_q, cu_k, max_q, max_k, *_ = _varlen_args("meta")
    with pytest.raises(TypeError, match="cu_seqlens_k must be a CUDA tensor"):
        ptxattn.torch.attention_varlen(q, k, v, cu_q, _on_cpu(cu_k), max_q, max_k)
    with pytest.raises(TypeError, match="cu_seqlens_q must have dtype int32, got torch.int64"):
        ptxattn.torch.attention_varlen(q, k, v, cu_q.long(), cu_k, max_q, max_k)
    with pytest.raises(TypeError, match="sinks must have dtype float32"):
        ptxattn.torch.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k,
                                       sinks=_bf16_zeros(q.shape[1]))

    q, k_cache, v_cache, lengths, _, table, k_new, v_new, *_ = _kvcache_args("meta")
    with pytest.raises(TypeError, match="q must be a CUDA tensor"):
        ptxattn.torch.attention_with_kvcache(_on_cpu(q), k_cache, v_cache, cache_seqlens=5)
    with pytest.raises(TypeError, match="cache_seqlens must be a CUDA tensor"):
        ptxattn.torch.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=_on_cpu(lengths),
                                             block_table=table)
    with pytest.raises(TypeError, match="block_table must have dtype int32"):
        ptxattn.torch.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths,
                                             block_table=table.long())
    with pytest.raises(TypeError, match="v_new must be a CUDA tensor"):
        ptxattn.torch.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths,
                                             block_table=table, k_new=k_new, v_new=_on_cpu(v_new))


# ---------------------------------------------------------------------------------------------
# GPU


def _cupy(x):
    import cupy
    return cupy.from_dlpack(x.detach())


def _normal(rng, *shapes, dtype=torch.bfloat16):
    """Standard normal CUDA tensors of the given shapes (bf16 by default), drawn from the test's
    seed."""
    generator = torch.Generator(device="cuda").manual_seed(int(rng.integers(2 ** 31)))
    return [torch.randn(shape, generator=generator, device="cuda").to(dtype) for shape in shapes]


def _inputs(rng, shape_q, shape_kv):
    """q, k, v and an upstream gradient for the output."""
    return _normal(rng, shape_q, shape_kv, shape_kv, shape_q)


def _ptxattn_step(q, k, v, dout, *, causal, **options):
    """ptxattn.torch's output, lse and (dq, dk, dv) for the upstream gradient dout."""
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out, lse = ptxattn.torch.attention(*leaves, causal=causal, return_lse=True, **options)
    out.backward(dout)
    return out.detach(), lse, tuple(leaf.grad for leaf in leaves)


def _sdpa_step(q, k, v, dout, *, causal):
    """torch SDPA's output and gradients, in ptxattn's (batch, seqlen, heads, dim) layout."""
    import torch.nn.functional as F

    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in leaves), is_causal=causal,
                                         enable_gqa=q.shape[2] != k.shape[2]).transpose(1, 2)
    out.backward(dout)
    return out.detach(), tuple(leaf.grad for leaf in leaves)


def _assert_near_sdpa(results, sdpa_results, q, k, v, dout, *, causal):
    """max |ours - SDPA| <= 2 * max |naive bf16 - FP32| + 2 * noise, for out, dq, dk, dv."""
    import cupy

    from ptxattn import reference

    cq, ck, cv, cdout = (_cupy(x) for x in (q, k, v, dout))
    refs = (reference.attention(cq, ck, cv, causal=causal),
            *reference.attention_backward(cdout, cq, ck, cv, causal=causal))
    naives = (reference.attention(cq, ck, cv, causal=causal, precision="input"),
              *reference.attention_backward(cdout, cq, ck, cv, causal=causal,
                                            precision="input"))
    for name, ours, theirs, ref, naive in zip(("out", "dq", "dk", "dv"), results, sdpa_results,
                                              refs, naives):
        noise = float(cupy.abs(ref.astype(cq.dtype).astype(cupy.float32) - ref).max())
        naive_err = float(cupy.abs(naive - ref).max())
        distance = float(cupy.abs(_cupy(ours).astype(cupy.float32)
                                  - _cupy(theirs).astype(cupy.float32)).max())
        assert distance <= 2 * naive_err + 2 * noise + 1e-6, (name, distance, naive_err, noise)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads", [(8, 8), (8, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_values_and_gradients_match_sdpa_and_fp32(causal, heads, head_dim, rng):
    from test_attention import _assert_close as assert_output_close
    from test_backward import _assert_close as assert_gradients_close

    heads_q, heads_kv = heads
    # equal lengths: SDPA's causal mask is top-left aligned, ptxattn's bottom-right
    q, k, v, dout = _inputs(rng, (2, 1000, heads_q, head_dim), (2, 1000, heads_kv, head_dim))
    out, lse, grads = _ptxattn_step(q, k, v, dout, causal=causal)
    sdpa_out, sdpa_grads = _sdpa_step(q, k, v, dout, causal=causal)
    assert out.dtype == torch.bfloat16 and all(g.dtype == torch.bfloat16 for g in grads)
    cq, ck, cv = (_cupy(x) for x in (q, k, v))
    assert_output_close(cq, ck, cv, _cupy(out), _cupy(lse), causal=causal)
    assert_gradients_close(tuple(_cupy(g) for g in grads), _cupy(dout), cq, ck, cv,
                           causal=causal)
    _assert_near_sdpa((out, *grads), (sdpa_out, *sdpa_grads), q, k, v, dout, causal=causal)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dims", HEAD_DIMS.values(), ids=HEAD_DIMS)
def test_narrower_values_and_head_dims_between_the_compiled_ones_match_fp32(head_dims, rng):
    """Causal GQA 8/2, 300 queries over 200 keys, v of head_dim_v: out (of head_dim_v) and
    every gradient against FP32 autograd, by the rule of the module docstring."""
    q, k, v = _leaves(head_dims, "cuda", requires_grad=False, rng=rng)
    dout = _normal(rng, (*q.shape[:-1], v.shape[-1]))[0]

    def attend(q, k, v, sinks):
        return ptxattn.torch.attention(q, k, v, causal=True)

    def reference(q, k, v, sinks):
        return _reference_attention(q, k, v, causal=True)

    out, *_ = _assert_gradients_match_fp32(attend, reference, q, k, v, None, dout)
    assert out.shape == dout.shape


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "e4m3"])
def test_mla_op_matches_the_cupy_entry_point(fp8, rng):
    """The op's output and lse are ptxattn.attention_mla_decode's on the same tensors, and the
    appended latent row reaches the caller's cache."""
    args = _mla_args("cuda", fp8, rng)
    q, kv_cache, lengths, _, table, kv_new, descale, *_ = args
    expected_cache = kv_cache.clone()
    expected_out, expected_lse = ptxattn.attention_mla_decode(
        q, expected_cache, cache_seqlens=lengths, block_table=table, kv_new=kv_new,
        kv_descale=descale, return_lse=True)
    out, lse = ptxattn.torch.attention_mla_decode(q, kv_cache, cache_seqlens=lengths,
                                                  block_table=table, kv_new=kv_new,
                                                  kv_descale=descale, return_lse=True)
    assert torch.equal(out, expected_out) and torch.equal(lse, expected_lse)
    assert torch.equal(kv_cache.view(torch.uint8), expected_cache.view(torch.uint8))


@pytest.mark.gpu
def test_strided_inputs_from_one_projection(rng):
    """q, k, v as views of one packed (batch, seqlen, 3, heads, dim) projection, the layout a
    model's fused QKV linear gives: read in place, gradients summed back into the packed leaf."""
    qkv, dout = _normal(rng, (2, 500, 3, 4, 128), (2, 500, 4, 128))
    leaf = qkv.clone().requires_grad_()
    out = ptxattn.torch.attention(*leaf.unbind(2), causal=True, deterministic=True)
    out.backward(dout)
    q, k, v = (x.contiguous() for x in qkv.unbind(2))
    expected_out, _, expected_grads = _ptxattn_step(q, k, v, dout, causal=True,
                                                    deterministic=True)
    assert torch.equal(out, expected_out)
    assert torch.equal(leaf.grad, torch.stack(expected_grads, dim=2))


@pytest.mark.gpu
@pytest.mark.parametrize("masks", MASKS.values(), ids=MASKS)
def test_opcheck_on_the_gpu(masks, rng):
    """As on meta tensors, but the real kernels' outputs checked against the fakes' metadata, and
    eager gradients against AOT-compiled ones (deterministic, so that they may be compared)."""
    q, k, v, dout = _inputs(rng, *SHAPES["gqa"])
    options, sinks = _split_sinks(masks, q.shape[2], "cuda", rng)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    sinks_leaf = None if sinks is None else sinks.clone().requires_grad_()
    torch.library.opcheck(torch.ops.ptxattn.attention_fwd.default,
                          _fwd_args(*leaves, deterministic=True, sinks=sinks_leaf, **options))
    out, lse = torch.ops.ptxattn.attention_fwd(*_fwd_args(q, k, v, sinks=sinks, **options))
    torch.library.opcheck(torch.ops.ptxattn.attention_bwd.default,
                          _bwd_args(dout, q, k, v, out, lse, deterministic=True, sinks=sinks,
                                    **options))


@pytest.mark.gpu
def test_side_stream_gives_the_default_streams_bits(rng):
    q, k, v, dout = _inputs(rng, *SHAPES["gqa"])
    expected = _ptxattn_step(q, k, v, dout, causal=True, deterministic=True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        got = _ptxattn_step(q, k, v, dout, causal=True, deterministic=True)
    torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    assert all(torch.equal(a, b) for a, b in zip(got[2], expected[2]))


@pytest.mark.gpu
def test_torch_compile_fullgraph_on_the_gpu(rng):
    """The compiled function (inductor, no graph break) gives eager's values and gradients, up to
    the rounding of the ops inductor fuses around the attention."""
    q, k, v, _ = _inputs(rng, *SHAPES["gqa"])

    def loss(q, k, v):
        out = ptxattn.torch.attention(q, k, v, causal=True, deterministic=True)
        return out.float().square().mean()

    results = _eager_and_compiled(loss, q, k, v)
    for eager, traced in zip(*results):
        torch.testing.assert_close(traced, eager)
    assert np.isfinite(float(results[1][0]))


def _eager_and_compiled(loss, q, k, v):
    """(loss, dq, dk, dv) of ``loss`` run eagerly and under torch.compile(fullgraph=True), on
    fresh leaves of q, k, v each."""
    compiled = torch.compile(loss, fullgraph=True)
    results = []
    for function in (loss, compiled):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        value = function(*leaves)
        value.backward()
        results.append((value.detach(), *(leaf.grad for leaf in leaves)))
    return results


# ---------------------------------------------------------------------------------------------
# The serving ops on the GPU: the same kernels as ptxattn's CuPy entry points (whose values
# tests/test_serving.py holds to the FP32 reference), so the same bits


def _varlen_through_cupy(args):
    """ptxattn.attention_varlen (the CuPy entry point) on CuPy views of the op's arguments."""
    import ptxattn

    (q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, window, softcap, sinks, _, check,
     backend) = args  # deterministic (the backward's) skipped
    return ptxattn.attention_varlen(
        *(_cupy(x) for x in (q, k, v, cu_q, cu_k)), max_q, max_k, causal=causal,
        softmax_scale=scale, window=window, softcap=softcap,
        sinks=None if sinks is None else _cupy(sinks), return_lse=True, check_contents=check,
        backend=backend)


def _kvcache_through_cupy(args):
    """ptxattn.attention_with_kvcache on CuPy views of the op's arguments, its caches clones
    (returned after the call, with the appended rows)."""
    import ptxattn

    (q, k_cache, v_cache, lengths, uniform, table, k_new, v_new, causal, window, softcap, sinks,
     scale, splits, check, backend) = args
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    out, lse = ptxattn.attention_with_kvcache(
        _cupy(q), _cupy(k_cache), _cupy(v_cache),
        cache_seqlens=uniform if lengths is None else _cupy(lengths), block_table=_cupy(table),
        k_new=_cupy(k_new), v_new=_cupy(v_new), causal=causal, window=window, softcap=softcap,
        sinks=sinks, softmax_scale=scale, num_splits=splits, return_lse=True,
        check_contents=check, backend=backend)
    return out, lse, k_cache, v_cache


def _same_bits(torch_tensor, cupy_array) -> bool:
    return torch.equal(torch_tensor, torch.from_dlpack(cupy_array))


@pytest.mark.gpu
@pytest.mark.parametrize("masks", VARLEN_MASKS.values(), ids=VARLEN_MASKS)
def test_varlen_op_gives_the_cupy_entry_points_bits(masks, rng):
    args = _varlen_case("cuda", masks, rng=rng)
    q, k, v, cu_q, cu_k, max_q, max_k, causal, _, window, softcap, sinks, *_ = args
    out, lse = ptxattn.torch.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal,
                                              window=window, softcap=softcap, sinks=sinks,
                                              return_lse=True)
    expected_out, expected_lse = _varlen_through_cupy(args)
    assert (out.dtype, lse.dtype, lse.shape) == (torch.bfloat16, torch.float32,
                                                 (q.shape[1], q.shape[0]))
    assert _same_bits(out, expected_out) and _same_bits(lse, expected_lse)


@pytest.mark.gpu
@pytest.mark.parametrize("cache_seqlens", [(3, 0, 40), 30], ids=["tensor", "int"])
def test_kvcache_op_appends_in_the_callers_caches_and_gives_the_cupy_entry_points_bits(
        cache_seqlens, rng):
    args = _kvcache_args("cuda", rng=rng, cache_seqlens=cache_seqlens)
    q, k_cache, v_cache, lengths, uniform, table, k_new, v_new, *_ = args
    expected_out, expected_lse, expected_k, expected_v = _kvcache_through_cupy(args)
    out, lse = ptxattn.torch.attention_with_kvcache(
        q, k_cache, v_cache, cache_seqlens=uniform if lengths is None else lengths,
        block_table=table, k_new=k_new, v_new=v_new, return_lse=True)
    assert (out.dtype, lse.dtype, lse.shape) == (torch.bfloat16, torch.float32,
                                                 (q.shape[0], q.shape[2], q.shape[1]))
    assert _same_bits(out, expected_out) and _same_bits(lse, expected_lse)
    assert _same_bits(k_cache, expected_k) and _same_bits(v_cache, expected_v)
    # the caller's own tensors hold the new rows where the page table puts them
    for b, length in enumerate(cache_seqlens if lengths is not None else [uniform] * 3):
        for cache, new in ((k_cache, k_new), (v_cache, v_new)):
            rows = cache[table[b].long()].reshape(-1, *cache.shape[2:])
            assert torch.equal(rows[length:length + new.shape[1]], new[b])


@pytest.mark.gpu
def test_serving_ops_under_torch_compile_fullgraph(rng):
    """Two decode steps and a varlen call in one inductor graph (no graph break): eager's bits,
    and the caller's caches hold both steps' rows, the second step having seen the first's."""
    args = _kvcache_args("cuda", rng=rng, cache_seqlens=10)
    q, k_cache, v_cache, _, _, table, k_new, v_new, *_ = args
    varlen = _varlen_args("cuda", rng=rng)

    def steps(q, k_cache, v_cache, k_new, v_new, length):
        first = ptxattn.torch.attention_with_kvcache(
            q, k_cache, v_cache, cache_seqlens=length, block_table=table, k_new=k_new,
            v_new=v_new)
        second = ptxattn.torch.attention_with_kvcache(
            q, k_cache, v_cache, cache_seqlens=length + 2, block_table=table, k_new=v_new,
            v_new=k_new)
        packed = ptxattn.torch.attention_varlen(*varlen[:7], causal=True)
        return first, second, packed

    eager_caches = (k_cache.clone(), v_cache.clone())
    eager = steps(q, *eager_caches, k_new, v_new, 10)
    compiled = torch.compile(steps, fullgraph=True)(q, k_cache, v_cache, k_new, v_new, 10)
    for a, b in zip(compiled, eager):
        assert torch.equal(a, b)
    assert torch.equal(k_cache, eager_caches[0]) and torch.equal(v_cache, eager_caches[1])
    rows = k_cache[table[0].long()].reshape(-1, *k_cache.shape[2:])
    assert torch.equal(rows[10:12], k_new[0]) and torch.equal(rows[12:14], v_new[0])


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore:Error detected in GeneratedBackward")
def test_a_gradient_through_the_kvcache_op_raises_on_the_gpu(rng):
    q, k_cache, v_cache, lengths, _, table, k_new, v_new, *_ = _kvcache_args(
        "cuda", requires_grad=True, rng=rng)
    out = ptxattn.torch.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths,
                                               block_table=table, k_new=k_new, v_new=v_new)
    with pytest.raises(RuntimeError, match="attention_with_kvcache_fwd.* no autograd formula"):
        out.float().square().sum().backward()


@pytest.mark.gpu
@pytest.mark.parametrize("masks", VARLEN_MASKS.values(), ids=VARLEN_MASKS)
def test_opcheck_varlen_ops_on_the_gpu(masks, rng):
    """The real kernels' outputs against the fakes' metadata, eager gradients against
    AOT-compiled ones (deterministic, so that they may be compared)."""
    args = _varlen_case("cuda", masks, requires_grad=True, rng=rng, deterministic=True)
    torch.library.opcheck(torch.ops.ptxattn.attention_varlen_fwd.default, args)
    args = tuple(x.detach() if isinstance(x, torch.Tensor) else x for x in args)
    out, lse = torch.ops.ptxattn.attention_varlen_fwd(*args)
    torch.library.opcheck(torch.ops.ptxattn.attention_varlen_bwd.default,
                          _varlen_bwd_args(args, out, lse))


@pytest.mark.gpu
def test_opcheck_kvcache_op_on_the_gpu(rng):
    """The real kernel's outputs against the fake's metadata, the caches' mutation against the
    schema, eager against AOT-compiled (appending the same rows again is idempotent)."""
    torch.library.opcheck(torch.ops.ptxattn.attention_with_kvcache_fwd.default,
                          _kvcache_args("cuda", rng=rng))


# ---------------------------------------------------------------------------------------------
# Training with a window, a softcap and sinks, fixed length and varlen: against torch autograd
# through the same math written in torch ops, in FP32 (the truth) and in the input dtype (the
# naive computation whose error is the yardstick)


def _reference_attention(q, k, v, sinks=None, *, causal=False, softmax_scale=None,
                         window=(-1, -1), softcap=0.0):
    """Attention by plain torch ops in q's dtype, differentiable by torch autograd; q
    (batch, seqlen_q, heads_q, dim), k and v (batch, seqlen_k, heads_kv, dim), seqlen_k >= 1.

    The scaled scores s, softcapped to softcap * tanh(s / softcap); key j visible from query i
    iff i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right (right 0 when
    causal, -1 unbounded on either side); exp(sink) of the query's head added to each row's
    denominator; 0 for a row that sees no key (and no sink)."""
    batch, seqlen_q, heads_q, head_dim = q.shape
    seqlen_k, heads_kv = k.shape[1], k.shape[2]
    scale = head_dim ** -0.5 if softmax_scale is None else softmax_scale
    q = q.transpose(1, 2)
    k, v = (x.repeat_interleave(heads_q // heads_kv, dim=2).transpose(1, 2) for x in (k, v))
    scores = (q @ k.transpose(-1, -2)) * scale
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    diagonal = torch.arange(seqlen_q, device=q.device)[:, None] + (seqlen_k - seqlen_q)
    key = torch.arange(seqlen_k, device=q.device)[None, :]
    left, right = window
    right = 0 if causal else right
    visible = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=q.device)
    if right >= 0:
        visible &= key <= diagonal + right
    if left >= 0:
        visible &= key >= diagonal - left
    logits = scores.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        sink_column = sinks.to(q.dtype).view(1, heads_q, 1, 1).expand(batch, heads_q, seqlen_q, 1)
        logits = torch.cat([logits, sink_column], dim=-1)
    # softmax's shift is a constant to the gradient; 0 for a row of -inf only
    row_max = logits.amax(dim=-1, keepdim=True).detach().nan_to_num(neginf=0.0)
    weights = torch.exp(logits - row_max)
    total = weights.sum(dim=-1, keepdim=True)
    probs = weights / total.masked_fill(total == 0, 1.0)
    return (probs[..., :seqlen_k] @ v).transpose(1, 2)


def _autograd_step(attend, q, k, v, sinks, dout, dtype=None):
    """``attend(q, k, v, sinks)``'s output and the gradients of (out * dout).sum() for q, k, v
    (and sinks, when given), by torch autograd on copies of the inputs, q, k, v and dout in
    ``dtype`` (their own by default; sinks stay float32)."""
    dtype = q.dtype if dtype is None else dtype
    leaves = [x.detach().to(dtype, copy=True).requires_grad_() for x in (q, k, v)]
    sinks_leaf = None if sinks is None else sinks.detach().clone().requires_grad_()
    out = attend(*leaves, sinks_leaf)
    out.backward(dout.to(dtype))
    grads = [leaf.grad for leaf in leaves] + ([] if sinks is None else [sinks_leaf.grad])
    return [out.detach(), *grads]


def _assert_within_naive_error(results, truths, naives, dtype):
    """out, dq, dk, dv (and dsinks): max |ours - FP32| <= 2 * max |naive - FP32| + 2 * noise,
    noise being the rounding of the FP32 result to ``dtype``."""
    for name, got, truth, naive in zip(("out", "dq", "dk", "dv", "dsinks"), results, truths,
                                       naives):
        assert got.shape == truth.shape, name
        assert bool(torch.isfinite(got).all()), f"{name} has NaN/Inf (or was not written)"
        noise = float((truth.to(dtype).float() - truth).abs().max())
        err = float((got.float() - truth).abs().max())
        naive_err = float((naive.float() - truth).abs().max())
        assert err <= 2 * naive_err + 2 * noise + 1e-6, (name, err, naive_err, noise)


def _assert_gradients_match_fp32(attend, reference, q, k, v, sinks, dout):
    """ptxattn's ``attend`` against ``reference`` (the same math) in FP32 and in q's dtype;
    returns ptxattn's out, dq, dk, dv (and dsinks)."""
    results = _autograd_step(attend, q, k, v, sinks, dout)
    truths = _autograd_step(reference, q, k, v, sinks, dout, torch.float32)
    naives = _autograd_step(reference, q, k, v, sinks, dout)
    _assert_within_naive_error(results, truths, naives, q.dtype)
    return results


# Options of the fixed-length training tests, "sinks" standing for a float32 (heads_q,) tensor
TRAINING_MASKS = {
    "window": {"window": (48, 16)},
    "causal-window": {"causal": True, "window": (100, 0)},
    "softcap": {"softcap": 3.0},
    "sinks": {"sinks": True},
    "causal-window-softcap-sinks": {"causal": True, "window": (64, 0), "softcap": 5.0,
                                    "sinks": True},
}


def _check_fixed_length_training(masks, seqlens, dtype, rng):
    """GQA 16/4, head_dim 128, batch 2: out and every gradient against FP32 autograd. (dsinks has
    one value a head, so its max error is over 16 values: over 4, chance alone put it past twice
    the naive run's in a few percent of draws.)"""
    seqlen_q, seqlen_k = seqlens
    q, k, v, dout = _normal(rng, (2, seqlen_q, 16, 128), (2, seqlen_k, 4, 128),
                            (2, seqlen_k, 4, 128), (2, seqlen_q, 16, 128), dtype=dtype)
    options, sinks = _split_sinks(masks, 16, "cuda", rng)

    def attend(q, k, v, sinks):
        return ptxattn.torch.attention(q, k, v, sinks=sinks, **options)

    def reference(q, k, v, sinks):
        return _reference_attention(q, k, v, sinks, **options)

    _assert_gradients_match_fp32(attend, reference, q, k, v, sinks, dout)


@pytest.mark.gpu
@pytest.mark.parametrize("seqlens", [(300, 200), (128, 384)], ids=lambda p: f"{p[0]}x{p[1]}")
@pytest.mark.parametrize("masks", TRAINING_MASKS.values(), ids=TRAINING_MASKS)
def test_gradients_with_window_softcap_sinks_match_fp32(masks, seqlens, rng):
    """300 queries over 200 keys: bottom-right alignment leaves rows that see no key (0 out, no
    gradient; with sinks, only the sink); 128 over 384: every row sees some."""
    _check_fixed_length_training(masks, seqlens, torch.bfloat16, rng)


@pytest.mark.gpu
def test_float16_gradients_with_window_softcap_sinks_match_fp32(rng):
    _check_fixed_length_training(TRAINING_MASKS["causal-window-softcap-sinks"], (300, 200),
                                 torch.float16, rng)


# varlen training: an empty sequence (no queries, 7 keys, which get no gradient), a one-token
# one and a long one of more keys than queries, GQA 4/2, head_dim 128
VARLEN_TRAINING = {"lengths_q": [0, 1, 300], "lengths_k": [7, 1, 333], "heads": (16, 4),
                   "head_dim": 128}
VARLEN_TRAINING_MASKS = {
    "causal": {"causal": True},
    "window-softcap-sinks": {"window": (32, 8), "softcap": 4.0, "sinks": True},
    "causal-window-sinks": {"causal": True, "window": (64, 0), "sinks": True},
}


def _per_sequence(reference, lengths_q, lengths_k):
    """``reference`` (fixed-length, batch 1) run on each sequence of a packed batch, the
    outputs packed back (a sequence without queries gives no rows)."""
    starts_q, starts_k = np.cumsum([0, *lengths_q]), np.cumsum([0, *lengths_k])

    def packed(q, k, v, sinks):
        outs = [reference(q[None, starts_q[b]:starts_q[b + 1]],
                          k[None, starts_k[b]:starts_k[b + 1]],
                          v[None, starts_k[b]:starts_k[b + 1]], sinks)[0]
                for b in range(len(lengths_q)) if lengths_q[b] > 0]
        return torch.cat(outs)

    return packed


@pytest.mark.gpu
@pytest.mark.parametrize("masks", VARLEN_TRAINING_MASKS.values(), ids=VARLEN_TRAINING_MASKS)
def test_varlen_gradients_match_per_sequence_fp32(masks, rng):
    lengths_q, lengths_k = VARLEN_TRAINING["lengths_q"], VARLEN_TRAINING["lengths_k"]
    heads_q, heads_kv = VARLEN_TRAINING["heads"]
    d = VARLEN_TRAINING["head_dim"]
    q, k, v, dout = _normal(rng, (sum(lengths_q), heads_q, d), (sum(lengths_k), heads_kv, d),
                            (sum(lengths_k), heads_kv, d), (sum(lengths_q), heads_q, d))
    cu_q, cu_k = (torch.tensor(np.cumsum([0, *lengths]), dtype=torch.int32, device="cuda")
                  for lengths in (lengths_q, lengths_k))
    options, sinks = _split_sinks(masks, heads_q, "cuda", rng)

    def attend(q, k, v, sinks):
        return ptxattn.torch.attention_varlen(q, k, v, cu_q, cu_k, max(lengths_q),
                                              max(lengths_k), sinks=sinks, **options)

    def reference(q, k, v, sinks):
        return _reference_attention(q, k, v, sinks, **options)

    _, _, dk, dv, *_ = _assert_gradients_match_fp32(
        attend, _per_sequence(reference, lengths_q, lengths_k), q, k, v, sinks, dout)
    # the empty sequence's keys: attended by no query, so exactly zero gradients
    assert not dk[:lengths_k[0]].any() and not dv[:lengths_k[0]].any()


@pytest.mark.gpu
def test_varlen_backward_under_torch_compile_fullgraph(rng):
    """A loss through attention_varlen (a window and sinks that require grad) compiled by
    inductor with no graph break, then its backward: eager's values and gradients, up to the
    rounding of the ops inductor fuses around the attention (in the bf16 gradient of out, which
    dsinks sums too: bf16's tolerance for every gradient)."""
    q, k, v, cu_q, cu_k, max_q, max_k, *_ = _varlen_args("cuda", rng=rng)
    sinks = _sinks(VARLEN["heads"][0], "cuda", rng)

    def loss(q, k, v, sinks):
        out = ptxattn.torch.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=True,
                                             window=(8, 0), sinks=sinks, deterministic=True)
        return out.float().square().mean()

    compiled = torch.compile(loss, fullgraph=True)
    results = []
    for function in (loss, compiled):
        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v, sinks)]
        value = function(*leaves)
        value.backward()
        results.append((value.detach(), *(leaf.grad for leaf in leaves)))
    (eager_loss, *eager_grads), (traced_loss, *traced_grads) = results
    torch.testing.assert_close(traced_loss, eager_loss)
    for eager, traced in zip(eager_grads, traced_grads):
        torch.testing.assert_close(traced, eager, rtol=1.6e-2, atol=1e-5)
    assert np.isfinite(float(traced_loss))
