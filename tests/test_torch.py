"""ptxattn.torch: the custom ops, their fakes, autograd, torch.compile.

CPU (fake and meta tensors, no GPU): the fakes give the real ops' shapes, dtypes and strides,
autograd reaches the backward op, torch.library.opcheck accepts both ops' registrations, and
torch.compile traces forward and backward with fullgraph=True.

GPU: values and gradients against torch SDPA and against FP32 attention, bf16, causal or not,
GQA. Tolerance, the rule of tests/test_attention.py and tests/test_backward.py (whose checks are
reused): against the FP32 reference (ptxattn.reference), each result's max error is at most
twice the max error of the same math done naively in bf16, plus twice the rounding noise of one
bf16 value. Against SDPA the same bound holds for the difference: both are fused kernels that
accumulate in FP32 and round far less than the naive computation, each at most about the naive
error away from FP32, so at most about twice that from each other.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")

import ptxattn.torch  # noqa: E402  after the skip: it imports torch

SHAPES = {"mha": ((2, 300, 8, 128), (2, 200, 8, 128)), "gqa": ((2, 300, 8, 64), (2, 200, 2, 64))}


def _fwd_args(q, k, v, deterministic=False):
    """attention_fwd's arguments: causal, default scale, default backend."""
    return (q, k, v, True, None, deterministic, None)


@pytest.mark.parametrize("kind", SHAPES)
def test_fake_forward_has_the_real_shapes_dtypes_and_strides(kind):
    from torch._subclasses.fake_tensor import FakeTensorMode

    shape_q, shape_kv = SHAPES[kind]
    with FakeTensorMode():
        q = torch.empty(shape_q, dtype=torch.bfloat16, device="cuda")
        k = v = torch.empty(shape_kv, dtype=torch.bfloat16, device="cuda")
        out, lse = ptxattn.torch.attention(q, k, v, causal=True, return_lse=True)
        dq, dk, dv = torch.ops.ptxattn.attention_bwd(out, q, k, v, out, lse, True, None, False,
                                                     None)
    assert (out.shape, out.dtype, out.device.type) == (q.shape, torch.bfloat16, "cuda")
    assert out.is_contiguous() and lse.is_contiguous()
    assert (lse.shape, lse.dtype) == ((shape_q[0], shape_q[2], shape_q[1]), torch.float32)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    assert dq.dtype == dk.dtype == dv.dtype == torch.bfloat16


def _meta_leaves(kind):
    shape_q, shape_kv = SHAPES[kind]
    return [torch.empty(shape, dtype=torch.bfloat16, device="meta", requires_grad=True)
            for shape in (shape_q, shape_kv, shape_kv)]


@pytest.mark.parametrize("kind", SHAPES)
def test_autograd_reaches_the_backward_op(kind):
    q, k, v = _meta_leaves(kind)
    out, lse = ptxattn.torch.attention(q, k, v, causal=True, return_lse=True)
    assert out.requires_grad and not lse.requires_grad  # lse carries no gradient
    out.sum().backward()
    for leaf in (q, k, v):
        assert leaf.grad.shape == leaf.shape and leaf.grad.dtype == torch.bfloat16


@pytest.mark.parametrize("kind", SHAPES)
def test_opcheck_on_meta_tensors(kind):
    """Schema (no input mutated), autograd registration, fake against the meta kernel, and AOT
    dispatch with dynamic shapes: the registrations' checks, which need no GPU."""
    q, k, v = _meta_leaves(kind)
    torch.library.opcheck(torch.ops.ptxattn.attention_fwd.default, _fwd_args(q, k, v))
    out, lse = torch.ops.ptxattn.attention_fwd(*_fwd_args(q.detach(), k.detach(), v.detach()))
    torch.library.opcheck(torch.ops.ptxattn.attention_bwd.default,
                          (out, q.detach(), k.detach(), v.detach(), out, lse, True, None, False,
                           None))


def test_compile_traces_forward_and_backward_in_one_graph():
    """fullgraph=True fails on any graph break; aot_eager runs the traced forward and backward
    graphs, here on meta tensors, so through the fakes."""
    q, k, v = _meta_leaves("gqa")

    @torch.compile(backend="aot_eager", fullgraph=True)
    def loss(q, k, v):
        return ptxattn.torch.attention(q, k, v, causal=True).float().square().mean()

    loss(q, k, v).backward()
    assert q.grad.shape == q.shape and v.grad.shape == v.shape


# ---------------------------------------------------------------------------------------------
# GPU


def _cupy(x):
    import cupy
    return cupy.from_dlpack(x.detach())


def _normal(rng, *shapes):
    """bf16 standard normal CUDA tensors of the given shapes, drawn from the test's seed."""
    generator = torch.Generator(device="cuda").manual_seed(int(rng.integers(2 ** 31)))
    return [torch.randn(shape, generator=generator, device="cuda").to(torch.bfloat16)
            for shape in shapes]


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
def test_opcheck_on_the_gpu(rng):
    """As on meta tensors, but the real kernels' outputs checked against the fakes' metadata, and
    eager gradients against AOT-compiled ones (deterministic, so that they may be compared)."""
    q, k, v, dout = _inputs(rng, *SHAPES["gqa"])
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    torch.library.opcheck(torch.ops.ptxattn.attention_fwd.default,
                          _fwd_args(*leaves, deterministic=True))
    out, lse = torch.ops.ptxattn.attention_fwd(*_fwd_args(q, k, v))
    torch.library.opcheck(torch.ops.ptxattn.attention_bwd.default,
                          (dout, q, k, v, out, lse, True, None, True, None))


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

    compiled = torch.compile(loss, fullgraph=True)
    results = []
    for function in (loss, compiled):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        value = function(*leaves)
        value.backward()
        results.append((value.detach(), *(leaf.grad for leaf in leaves)))
    for eager, traced in zip(*results):
        torch.testing.assert_close(traced, eager)
    assert np.isfinite(float(results[1][0]))
