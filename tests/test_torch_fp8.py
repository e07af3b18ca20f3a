"""ptxattn.torch.fp8_attention: its custom ops, their fakes, autograd, torch.compile, and the
recipe it takes (ptxattn.quant.recipe.Fp8Recipe).

CPU (fake and meta tensors, no GPU): Fp8Recipe's defaults, v's granularity and its errors, each
naming the field; the fakes give the real ops' shapes, dtypes and strides (the descales' of each
granularity, v's per head where q and k take blocks); autograd reaches the backward op and gives
q, k, v gradients of their shapes and dtype while lse and the quantized inputs carry none;
torch.library.opcheck accepts both ops' registrations; torch.compile traces forward and backward
with fullgraph=True; fp8_attention refuses a CPU tensor, a dtype other than float16 and
bfloat16, k or v of another dtype than q's, and a recipe that is no Fp8Recipe, with a TypeError
naming the argument. Rotating gradients back, (x R) R^T = x, on CPU tensors.

GPU: gradients against FP32 autograd of plain attention on the same bf16 inputs, as relative
RMSE (||g - g_fp32|| / ||g_fp32||) of dq, dk and dv, each at most 1.5 times the figure that
docs/design/fp8.md's table "Backward: which GEMMs can take e4m3" gives with every GEMM in e4m3
for standard normal inputs (its emulation sums in FP32; an e4m3 wgmma keeps fewer bits of its
sums, which the margin covers), rotated or not, causal or not, GQA 8/2, head_dim 128 and 64;
every gradient finite and nonzero in every row, float16 too; the forward op's quantized inputs,
descales, out and lse are the CuPy entry points' (fp8.quantize_qkv, fp8.attention) bit for bit,
the backward op's gradients fp8.attention_backward's; opcheck with the real kernels; under
torch.compile (inductor, fullgraph) eager's values and gradients.
"""

import dataclasses

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")

import ptxattn.torch  # noqa: E402  after the skip: it imports torch
from ptxattn.quant.fp8 import GRANULARITIES  # noqa: E402
from ptxattn.quant.hadamard import hadamard_rotation  # noqa: E402
from ptxattn.quant.recipe import Fp8Recipe  # noqa: E402

# (q, k/v) shapes: 300 queries over 200 keys (3 and 2 descale blocks of 128 rows), GQA 8/2
SHAPES = {"d128": ((2, 300, 8, 128), (2, 200, 2, 128)), "d64": ((2, 300, 8, 64), (2, 200, 2, 64))}
# The descale shapes of SHAPES' q and k/v, by granularity: v takes "head" for "block"
DESCALE_SHAPES = {"tensor": ((), (), ()), "head": ((2, 8), (2, 2), (2, 2)),
                  "block": ((2, 8, 3), (2, 2, 2), (2, 2))}
RECIPES = {"block": Fp8Recipe(), "block-rotated": Fp8Recipe("block", rotate=True, seed=7),
           "head": Fp8Recipe("head"), "tensor-rotated": Fp8Recipe("tensor", rotate=True)}


def _fwd_args(q, k, v, recipe=Fp8Recipe(), causal=True, deterministic=False):
    """fp8_attention_fwd's arguments: default scale."""
    return (q, k, v, causal, None, recipe.granularity, recipe.rotate, recipe.seed, deterministic)


def _bwd_args(dout, forward, recipe=Fp8Recipe(), causal=True, deterministic=False):
    """fp8_attention_bwd's arguments from the forward op's outputs."""
    out, lse, q8, k8, v8, q_descale, k_descale, v_descale = forward
    return (dout, q8, k8, v8, out, lse, q_descale, k_descale, v_descale, causal, None,
            recipe.rotate, recipe.seed, deterministic)


def _leaves(kind="d128", device="meta", dtype=torch.bfloat16, requires_grad=True):
    """q, k, v of SHAPES[kind], zeros (on meta and fake devices values do not matter)."""
    shape_q, shape_kv = SHAPES[kind]
    return [torch.zeros(shape, dtype=dtype, device=device).requires_grad_(requires_grad)
            for shape in (shape_q, shape_kv, shape_kv)]


# ---------------------------------------------------------------------------------------------
# Fp8Recipe


def test_recipe_defaults_to_blocks_without_rotation_and_is_frozen():
    recipe = Fp8Recipe()
    assert (recipe.granularity, recipe.rotate, recipe.seed) == ("block", False, 0)
    assert recipe == Fp8Recipe("block", False, 0) and hash(recipe) == hash(Fp8Recipe())
    with pytest.raises(dataclasses.FrozenInstanceError):
        recipe.rotate = True


@pytest.mark.parametrize("granularity, v_granularity",
                         [("tensor", "tensor"), ("head", "head"), ("block", "head")])
def test_recipe_quantizes_v_per_head_where_q_and_k_take_blocks(granularity, v_granularity):
    assert Fp8Recipe(granularity).v_granularity == v_granularity


@pytest.mark.parametrize("fields, error, message", [
    ({"granularity": "row"}, ValueError, r"Fp8Recipe.granularity must be one of \('tensor', "
                                         r"'head', 'block'\), got 'row'"),
    ({"granularity": None}, TypeError, "Fp8Recipe.granularity must be a str"),
    ({"rotate": 1}, TypeError, "Fp8Recipe.rotate must be a bool, got int"),
    ({"seed": -1}, ValueError, "Fp8Recipe.seed must be non-negative and below 2\\*\\*63, got -1"),
    ({"seed": 2 ** 63}, ValueError, "Fp8Recipe.seed must be non-negative"),
    ({"seed": 1.0}, TypeError, "Fp8Recipe.seed must be an int, got float"),
    ({"seed": True}, TypeError, "Fp8Recipe.seed must be an int, got bool"),
], ids=["granularity", "granularity-type", "rotate", "negative-seed", "large-seed", "float-seed",
        "bool-seed"])
def test_recipe_names_the_field_it_refuses(fields, error, message):
    with pytest.raises(error, match=message):
        Fp8Recipe(**fields)


# ---------------------------------------------------------------------------------------------
# The ops on fake and meta tensors


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("kind", SHAPES)
def test_fakes_have_the_real_shapes_dtypes_and_strides(kind, dtype, granularity):
    from torch._subclasses.fake_tensor import FakeTensorMode

    recipe = Fp8Recipe(granularity, rotate=True)
    with FakeTensorMode():
        q, k, v = _leaves(kind, "cuda", dtype, requires_grad=False)
        forward = torch.ops.ptxattn.fp8_attention_fwd(*_fwd_args(q, k, v, recipe))
        out, lse, q8, k8, v8, *descales = forward
        grads = torch.ops.ptxattn.fp8_attention_bwd(*_bwd_args(out, forward, recipe))
    assert (out.shape, out.dtype, out.device.type) == (q.shape, dtype, "cuda")
    assert (lse.shape, lse.dtype) == ((2, 8, 300), torch.float32)
    for x, x8 in zip((q, k, v), (q8, k8, v8)):
        assert (x8.shape, x8.dtype) == (x.shape, torch.float8_e4m3fn)
    assert [tuple(d.shape) for d in descales] == list(DESCALE_SHAPES[granularity])
    assert all(d.dtype == torch.float32 for d in descales)
    assert all(x.is_contiguous() for x in (out, lse, q8, k8, v8, *descales))
    # gradients in out's dtype, of the inputs' shapes
    assert [(g.shape, g.dtype) for g in grads] == [(x.shape, dtype) for x in (q, k, v)]
    assert all(g.is_contiguous() for g in grads)


@pytest.mark.parametrize("recipe", RECIPES.values(), ids=RECIPES)
def test_autograd_reaches_the_backward_op(recipe):
    q, k, v = _leaves("d64")
    out, lse, *quantized = torch.ops.ptxattn.fp8_attention_fwd(*_fwd_args(q, k, v, recipe))
    assert out.requires_grad
    assert not any(x.requires_grad for x in (lse, *quantized))  # constants to the caller
    out = ptxattn.torch.fp8_attention(q, k, v, causal=True, recipe=recipe)
    out.float().square().mean().backward()
    for leaf in (q, k, v):
        assert (leaf.grad.shape, leaf.grad.dtype) == (leaf.shape, torch.bfloat16)


@pytest.mark.parametrize("recipe", RECIPES.values(), ids=RECIPES)
def test_opcheck_on_meta_tensors(recipe):
    """Schema (no input mutated), autograd registration, fake against the meta kernel, and AOT
    dispatch with dynamic shapes, for both ops."""
    q, k, v = _leaves()
    torch.library.opcheck(torch.ops.ptxattn.fp8_attention_fwd.default,
                          _fwd_args(q, k, v, recipe))
    q, k, v = (x.detach() for x in (q, k, v))
    forward = torch.ops.ptxattn.fp8_attention_fwd(*_fwd_args(q, k, v, recipe))
    torch.library.opcheck(torch.ops.ptxattn.fp8_attention_bwd.default,
                          _bwd_args(forward[0], forward, recipe))


def test_compile_traces_forward_and_backward_in_one_graph():
    """fullgraph=True fails on any graph break; aot_eager runs the traced forward and backward
    graphs, here on meta tensors, so through the fakes."""
    q, k, v = _leaves()
    recipe = RECIPES["block-rotated"]

    @torch.compile(backend="aot_eager", fullgraph=True)
    def loss(q, k, v):
        return ptxattn.torch.fp8_attention(q, k, v, causal=True, recipe=recipe).float().mean()

    loss(q, k, v).backward()
    assert all(leaf.grad.shape == leaf.shape for leaf in (q, k, v))


def test_the_ops_refuse_an_unknown_granularity():
    q, k, v = _leaves(requires_grad=False)
    with pytest.raises(ValueError, match="Fp8Recipe.granularity must be one of"):
        torch.ops.ptxattn.fp8_attention_fwd(q, k, v, True, None, "row", False, 0, False)


# ---------------------------------------------------------------------------------------------
# Argument checks before the op


@pytest.mark.parametrize("position", [0, 1, 2], ids=["q", "k", "v"])
def test_a_cpu_tensor_is_refused_by_name(position):
    tensors = _leaves(requires_grad=False)
    tensors[position] = torch.zeros_like(tensors[position], device="cpu")
    name = "qkv"[position]
    with pytest.raises(TypeError, match=rf"{name} must be a CUDA tensor \(ptxattn's kernels run "
                                        rf"on the GPU\), got a tensor on cpu"):
        ptxattn.torch.fp8_attention(*tensors)


def test_dtypes_are_checked_by_name():
    q, k, v = _leaves(requires_grad=False)
    with pytest.raises(TypeError, match="q must have dtype float16 or bfloat16, got "
                                        "torch.float32"):
        ptxattn.torch.fp8_attention(q.float(), k, v)
    with pytest.raises(TypeError, match="k must have dtype float16 or bfloat16, got "
                                        "torch.float8_e4m3fn"):
        ptxattn.torch.fp8_attention(q, k.to(torch.float8_e4m3fn), v)
    with pytest.raises(TypeError, match="v must have q's dtype, torch.bfloat16, got "
                                        "torch.float16"):
        ptxattn.torch.fp8_attention(q, k, v.half())
    with pytest.raises(TypeError, match="q must be a torch.Tensor on a CUDA device"):
        ptxattn.torch.fp8_attention(np.zeros(q.shape, np.float16), k, v)


@pytest.mark.parametrize("recipe", ["block", {"granularity": "block"}, ("block", True, 0)],
                         ids=["str", "dict", "tuple"])
def test_a_recipe_that_is_no_fp8_recipe_is_refused(recipe):
    q, k, v = _leaves(requires_grad=False)
    with pytest.raises(TypeError, match="recipe must be a ptxattn.fp8.Fp8Recipe or None, got "):
        ptxattn.torch.fp8_attention(q, k, v, recipe=recipe)


@pytest.mark.parametrize("head_dim", [32, 96, 192])
def test_head_dims_without_a_backward_are_refused_before_the_forward(head_dim):
    """The FP8 forward runs these; its backward does not, so the op refuses them up front."""
    q, k, v = (torch.zeros(shape, dtype=torch.bfloat16, device="meta")
               for shape in ((1, 64, 2, head_dim), (1, 64, 2, head_dim), (1, 64, 2, head_dim)))
    with pytest.raises(ValueError, match=rf"q: head_dim must be one of \(64, 128, 256\) for "
                                         rf"fp8_attention \(its backward's\), got {head_dim}"):
        ptxattn.torch.fp8_attention(q, k, v)


# ---------------------------------------------------------------------------------------------
# Rotating gradients back


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_rotating_back_undoes_the_quantizers_rotation(head_dim):
    """For x R (R the rotation quantize_qkv draws from the seed), _rotated_back gives x up to
    the rounding of x R to bf16; R of another seed does not."""
    generator = torch.Generator().manual_seed(head_dim)
    x = torch.randn(2, 50, 3, head_dim, generator=generator)
    matrix = torch.from_numpy(hadamard_rotation(head_dim, seed=5).matrix()).float()
    rotated = (x @ matrix).to(torch.bfloat16)
    same = ptxattn.torch._rotation_matrix(head_dim, 5, torch.device("cpu"))
    other = ptxattn.torch._rotation_matrix(head_dim, 6, torch.device("cpu"))
    assert torch.equal(same, matrix)
    back = ptxattn.torch._rotated_back(rotated, same)
    assert back.dtype == torch.bfloat16 and back.shape == x.shape
    # bf16 keeps 8 bits: twice its relative rounding, 2^-8, bounds the two roundings' sum
    assert float((back.float() - x).norm() / x.norm()) < 2 ** -7
    wrong = ptxattn.torch._rotated_back(rotated, other)
    assert float((wrong.float() - x).norm() / x.norm()) > 0.5


# ---------------------------------------------------------------------------------------------
# GPU

# docs/design/fp8.md, "Backward: which GEMMs can take e4m3": relative RMSE of (dq, dk, dv)
# against FP32 autograd on the bf16 inputs with all five backward GEMMs in e4m3 (q, k rotated
# for the last column), standard normal inputs, by (causal, rotate)
ALL_E4M3_RMSE = {(False, False): (0.0664, 0.0658, 0.0532), (True, False): (0.0650, 0.0645, 0.0486),
                 (False, True): (0.0664, 0.0658, 0.0532), (True, True): (0.0650, 0.0643, 0.0487)}
# the emulation's sums are FP32; an e4m3 wgmma keeps fewer bits of its sums
RMSE_MARGIN = 1.5


def _relative_rmse(got: torch.Tensor, truth: torch.Tensor) -> float:
    return float((got.float() - truth).norm() / truth.norm())


def _inputs(rng, kind="d128"):
    """Standard normal bf16 q, k, v of SHAPES[kind] and an upstream gradient for the output."""
    from test_torch import _normal

    shape_q, shape_kv = SHAPES[kind]
    return _normal(rng, shape_q, shape_kv, shape_kv, shape_q)


def _bits(x: torch.Tensor) -> torch.Tensor:
    """x, or for e4m3 its bytes (torch.equal takes no float8)."""
    return x.view(torch.uint8) if x.dtype == torch.float8_e4m3fn else x


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [128, 64])
@pytest.mark.parametrize("rotate", [False, True], ids=["plain", "rotated"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_gradients_match_fp32_within_the_designs_error(causal, rotate, head_dim, rng):
    """Batch 1, 1024 queries and keys (the table's), GQA 8/2, standard normal bf16 q, k, v and
    upstream gradient, the rotation's seed drawn from the test's."""
    from test_torch import _autograd_step, _normal, _reference_attention

    q, k, v, dout = _normal(rng, (1, 1024, 8, head_dim), (1, 1024, 2, head_dim),
                            (1, 1024, 2, head_dim), (1, 1024, 8, head_dim))
    recipe = Fp8Recipe("block", rotate=rotate, seed=int(rng.integers(2 ** 31)))

    def attend(q, k, v, sinks):
        return ptxattn.torch.fp8_attention(q, k, v, causal=causal, recipe=recipe)

    def reference(q, k, v, sinks):
        return _reference_attention(q, k, v, causal=causal)

    out, *grads = _autograd_step(attend, q, k, v, None, dout)
    _, *truths = _autograd_step(reference, q, k, v, None, dout, torch.float32)
    assert all(x.dtype == torch.bfloat16 for x in (out, *grads))
    bounds = [RMSE_MARGIN * figure for figure in ALL_E4M3_RMSE[causal, rotate]]
    errors = [_relative_rmse(g, t) for g, t in zip(grads, truths)]
    for name, error, bound in zip(("dq", "dk", "dv"), errors, bounds):
        assert error <= bound, (name, error, bound, errors)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("recipe", RECIPES.values(), ids=RECIPES)
def test_gradients_are_finite_and_nonzero_in_every_row(recipe, dtype, rng):
    """Causal, 200 queries over 300 keys (every query sees 101 keys or more), GQA 8/2: no NaN
    or Inf, and no row of dq, dk or dv all zeros (a block the kernel left unwritten, a head it
    skipped)."""
    from test_torch import _autograd_step, _normal

    q, k, v, dout = _normal(rng, (2, 200, 8, 128), (2, 300, 2, 128), (2, 300, 2, 128),
                            (2, 200, 8, 128), dtype=dtype)

    def attend(q, k, v, sinks):
        return ptxattn.torch.fp8_attention(q, k, v, causal=True, recipe=recipe)

    out, *grads = _autograd_step(attend, q, k, v, None, dout)
    for name, g, x in zip(("dq", "dk", "dv"), grads, (q, k, v)):
        assert (g.shape, g.dtype) == (x.shape, dtype), name
        assert bool(torch.isfinite(g).all()), f"{name} has NaN/Inf"
        assert bool((g.abs().amax(dim=-1) > 0).all()), f"{name} has a row of zeros"


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", RECIPES.values(), ids=RECIPES)
def test_ops_give_the_cupy_entry_points_bits(recipe, rng):
    """The forward op is fp8.quantize_qkv with the recipe's fields, then fp8.attention; the
    backward op without rotation is fp8.attention_backward (deterministic). A rotated recipe's
    q8 differs from the unrotated quantization (the rotation is applied)."""
    from ptxattn import fp8

    q, k, v, dout = _inputs(rng)
    forward = torch.ops.ptxattn.fp8_attention_fwd(*_fwd_args(q, k, v, recipe))
    q8, k8, v8, descales = fp8.quantize_qkv(q, k, v, recipe.granularity, recipe.rotate,
                                            recipe.seed)
    out, lse = fp8.attention(q8, k8, v8, **descales, causal=True, out_dtype="bfloat16",
                             return_lse=True)
    expected = (out, lse, q8, k8, v8, descales["q_descale"], descales["k_descale"],
                descales["v_descale"])
    for name, got, want in zip(("out", "lse", "q8", "k8", "v8", "q_descale", "k_descale",
                                "v_descale"), forward, expected):
        assert got.dtype == want.dtype and torch.equal(_bits(got), _bits(want)), name
    if recipe.rotate:
        unrotated, _ = fp8.quantize(q, recipe.granularity)
        assert not torch.equal(_bits(forward[2]), _bits(unrotated))
        return
    grads = torch.ops.ptxattn.fp8_attention_bwd(*_bwd_args(dout, forward, recipe,
                                                           deterministic=True))
    expected_grads = fp8.attention_backward(dout, q8, k8, v8, out, lse, **descales,
                                            causal=True, deterministic=True)
    for name, got, want in zip(("dq", "dk", "dv"), grads, expected_grads):
        assert torch.equal(got, want), name


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", RECIPES.values(), ids=RECIPES)
def test_opcheck_on_the_gpu(recipe, rng):
    """As on meta tensors, but the real kernels' outputs checked against the fakes' metadata,
    and eager gradients against AOT-compiled ones (deterministic, so that they may be
    compared)."""
    q, k, v, dout = _inputs(rng)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    # The forward's AOT check sums every output to backpropagate, and CUDA has no sum of
    # float8_e4m3fn (its q8, k8, v8); test_torch_compile_fullgraph_on_the_gpu compiles the
    # forward and backward through AOT instead.
    torch.library.opcheck(torch.ops.ptxattn.fp8_attention_fwd.default,
                          _fwd_args(*leaves, recipe, deterministic=True),
                          test_utils=("test_schema", "test_autograd_registration",
                                      "test_faketensor"))
    forward = torch.ops.ptxattn.fp8_attention_fwd(*_fwd_args(q, k, v, recipe))
    torch.library.opcheck(torch.ops.ptxattn.fp8_attention_bwd.default,
                          _bwd_args(dout, forward, recipe, deterministic=True))


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", RECIPES.values(), ids=RECIPES)
def test_torch_compile_fullgraph_on_the_gpu(recipe, rng):
    """The compiled function (inductor, no graph break) gives eager's values and gradients, up to
    the rounding of the ops inductor fuses around the attention."""
    q, k, v, _ = _inputs(rng)

    def loss(q, k, v):
        out = ptxattn.torch.fp8_attention(q, k, v, causal=True, recipe=recipe,
                                          deterministic=True)
        return out.float().square().mean()

    from test_torch import _eager_and_compiled

    results = _eager_and_compiled(loss, q, k, v)
    for eager, traced in zip(*results):
        torch.testing.assert_close(traced, eager)
    assert np.isfinite(float(results[1][0])) and float(results[1][0]) > 0
