"""ptxattn.torch's SDPA backend: enable_sdpa, disable_sdpa and the context manager sdpa_enabled.

CPU: on a torch without the registry of flash-attention implementations (a stand-in
torch.nn.attention) all three raise a RuntimeError naming torch's version and the missing
functions. Through a stand-in registry with torch 2.11's rules, sdpa_enabled activates "ptxattn"
and activates again what was active before (torch's default, another implementation, an
enclosing block's "ptxattn"), also when the block raises, and disable_sdpa takes back "ptxattn"
only. With torch's own registry, ptxattn's kernels hold the CUDA entries of SDPA's two flash ops
inside the block and torch's hold them again after it. Which calls ptxattn takes
(_ptxattn_runs, on meta tensors): 16-bit, head_dim a multiple of 8 up to 256 (80 and 8 too, not
12 or 264), value's head_dim a multiple of 8 at most the query's (key's the query's), GQA, no
dropout, a finite positive scale, a GPU ptxattn runs on; the forward's output has value's
head_dim in query's layout.

GPU: F.scaled_dot_product_attention inside sdpa_enabled() with torch's backends limited to flash
(torch 2.11 tries cuDNN before flash on sm_90) runs ptxattn's forward and backward, once each
(counted at ptxattn.api's entry points), and gives, bit for bit, what ptxattn.torch.attention
gives (both with deterministic gradients), eagerly and under torch.compile; its out, dq, dk and
dv are held to FP32 by the rule of tests/test_torch.py: max error at most twice that of the same
math done naively in bf16, plus twice the rounding noise of one bf16 value, head_dim 80 among
them. Calls ptxattn cannot run (an attn_mask, float32, causal with seqlen_q != seqlen_k,
dropout) never reach ptxattn and give what torch gives without it (the forward bit for bit, the
gradients to the dtype's tolerance: torch's backward kernels add in no fixed order). The flash
op called directly aligns causal bottom-right for seqlen_q != seqlen_k, ptxattn's kernels as
torch's own, and takes a value head_dim below the query's (192/128) on ptxattn's kernels. On
exit the implementation active before is back: torch's forward gives its bits of before the
block.
"""

import contextlib
import re
import types

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")

import ptxattn  # noqa: E402  after the skip: ptxattn.torch imports torch
import ptxattn.torch  # noqa: E402
from test_torch import (_assert_within_naive_error, _autograd_step, _normal,  # noqa: E402
                        _reference_attention)


def _registry_missing() -> str:
    """Why this torch has no registry of flash-attention implementations to test with ("" when
    it has one): enable_sdpa's own message."""
    try:
        ptxattn.torch._flash_attention_registry()
    except RuntimeError as err:
        return str(err)
    return ""


REGISTRY_MISSING = _registry_missing()
needs_registry = pytest.mark.skipif(bool(REGISTRY_MISSING), reason=REGISTRY_MISSING or "-")

# The registry functions ptxattn uses, the last one new in torch 2.11
REGISTRY_FUNCTIONS = ("register_flash_attention_impl", "activate_flash_attention_impl",
                      "current_flash_attention_impl", "restore_flash_attention_impl")
# SDPA's two flash ops, whose CUDA kernels sdpa_enabled() swaps
FLASH_OPS = ("aten::_scaled_dot_product_flash_attention",
             "aten::_scaled_dot_product_flash_attention_backward")


# ---------------------------------------------------------------------------------------------
# CPU: the registry, through stand-ins and torch's own


@pytest.mark.parametrize("version, present", [("2.10.0", 3), ("2.9.1", 0)],
                         ids=["without-restore", "without-any"])
def test_old_torch_gets_an_error_naming_its_version_and_the_missing_functions(monkeypatch,
                                                                             version, present):
    """torch 2.10 has every registry function but restore_flash_attention_impl, older ones none."""
    stand_in = types.ModuleType("torch.nn.attention")
    for name in REGISTRY_FUNCTIONS[:present]:
        setattr(stand_in, name, lambda *args, **kwargs: None)
    monkeypatch.setattr(torch.nn, "attention", stand_in)
    monkeypatch.setattr(torch, "__version__", version)
    missing = ", ".join(f"torch.nn.attention.{name}" for name in REGISTRY_FUNCTIONS[present:])
    message = f"needs torch 2.11 or newer: torch {version} has no {missing}"
    for call in (ptxattn.torch.enable_sdpa, ptxattn.torch.disable_sdpa,
                 lambda: ptxattn.torch.sdpa_enabled().__enter__()):
        with pytest.raises(RuntimeError, match=re.escape(message)):
            call()


class _Handle:
    def remove(self):
        pass


class _Registry(types.ModuleType):
    """A stand-in for torch.nn.attention's registry with torch 2.11's rules: activating an
    implementation first restores the default, removing the active one's handle; "FA4" is
    registered, with a handle that registers nothing."""

    def __init__(self, active=None):
        super().__init__("torch.nn.attention")
        self.register_fns = {"FA4": _Handle}
        self.active = None  # (name, handle)
        if active is not None:
            self.activate_flash_attention_impl(active)

    def register_flash_attention_impl(self, impl, *, register_fn):
        self.register_fns[impl] = register_fn

    def activate_flash_attention_impl(self, impl):
        self.restore_flash_attention_impl()
        self.active = (impl, self.register_fns[impl]())

    def current_flash_attention_impl(self):
        return None if self.active is None else self.active[0]

    def restore_flash_attention_impl(self):
        if self.active is not None:
            self.active[1].remove()
        self.active = None


@pytest.fixture
def stand_in_registry(monkeypatch):
    """Makes a _Registry torch.nn.attention, with the implementation given (``.active``: None,
    "FA4" or "ptxattn") active; the default is restored after the test, so that ptxattn's
    kernels do not outlive it."""
    registries = []

    def make(active=None):
        registry = _Registry()
        monkeypatch.setattr(torch.nn, "attention", registry)
        if active == "ptxattn":
            ptxattn.torch.enable_sdpa()
        elif active is not None:
            registry.activate_flash_attention_impl(active)
        registries.append(registry)
        return registry

    yield make
    for registry in registries:
        registry.restore_flash_attention_impl()


@pytest.mark.parametrize("previous", [None, "FA4", "ptxattn"])
def test_sdpa_enabled_activates_the_previous_implementation_again(stand_in_registry, previous):
    registry = stand_in_registry(previous)
    with ptxattn.torch.sdpa_enabled():
        assert registry.current_flash_attention_impl() == "ptxattn"
    assert registry.current_flash_attention_impl() == previous


@pytest.mark.parametrize("previous", [None, "FA4"])
def test_sdpa_enabled_restores_when_the_block_raises(stand_in_registry, previous):
    registry = stand_in_registry(previous)
    with pytest.raises(KeyError):
        with ptxattn.torch.sdpa_enabled():
            raise KeyError("inside the block")
    assert registry.current_flash_attention_impl() == previous


def test_nested_blocks_each_restore_their_own_previous(stand_in_registry):
    registry = stand_in_registry("FA4")
    with ptxattn.torch.sdpa_enabled():
        with ptxattn.torch.sdpa_enabled():
            assert registry.current_flash_attention_impl() == "ptxattn"
        assert registry.current_flash_attention_impl() == "ptxattn"
    assert registry.current_flash_attention_impl() == "FA4"


@pytest.mark.parametrize("active, after", [("ptxattn", None), ("FA4", "FA4"), (None, None)])
def test_disable_sdpa_takes_back_ptxattn_only(stand_in_registry, active, after):
    registry = stand_in_registry(active)
    ptxattn.torch.disable_sdpa()
    assert registry.current_flash_attention_impl() == after


def _cuda_kernels() -> dict[str, str]:
    """Each SDPA flash op's CUDA entry in torch's dispatcher, "CUDA: registered at FILE:LINE
    ...", or "" where it has none (a CPU-only torch)."""
    entries = {}
    for op in FLASH_OPS:
        lines = torch._C._dispatch_dump(op).splitlines()
        entries[op] = next((line for line in lines if line.startswith("CUDA:")), "")
    return entries


@needs_registry
def test_ptxattn_kernels_hold_the_flash_ops_inside_the_block_only():
    """Through torch's own registry: ptxattn/torch.py registered the CUDA kernels of both flash
    ops inside the block, and torch's own entries (none on a CPU-only torch) are back after it."""
    registry = torch.nn.attention
    assert registry.current_flash_attention_impl() is None
    before = _cuda_kernels()
    with ptxattn.torch.sdpa_enabled():
        assert registry.current_flash_attention_impl() == "ptxattn"
        assert "ptxattn" in registry.list_flash_attention_impls()
        for op, entry in _cuda_kernels().items():
            assert "ptxattn/torch.py:" in entry, (op, entry)
    assert registry.current_flash_attention_impl() is None
    assert _cuda_kernels() == before


def _meta_qkv(dtype=torch.bfloat16, head_dim=128, heads=(8, 8), seqlens=(64, 64),
              head_dim_k=None, head_dim_v=None):
    """q (2, heads_q, seqlen_q, head_dim), k (2, heads_kv, seqlen_k, head_dim_k) and v
    (2, heads_kv, seqlen_k, head_dim_v), SDPA's layout, on the meta device; k's and v's head
    dims q's unless given."""
    (heads_q, heads_kv), (seqlen_q, seqlen_k) = heads, seqlens
    q = torch.empty((2, heads_q, seqlen_q, head_dim), dtype=dtype, device="meta")
    k, v = (torch.empty((2, heads_kv, seqlen_k, head_dim if dim is None else dim), dtype=dtype,
                        device="meta")
            for dim in (head_dim_k, head_dim_v))
    return q, k, v


# name -> (arch, _meta_qkv's options, dropout_p, is_causal, scale, whether ptxattn runs it)
ELIGIBILITY = {
    "hopper": ("sm_90a", {}, 0.0, True, None, True),
    "portable-sm80": ("sm_80", {}, 0.0, False, None, True),
    "gqa": ("sm_90a", {"heads": (8, 2)}, 0.0, True, None, True),
    "head_dim-64": ("sm_90a", {"head_dim": 64}, 0.0, False, 0.125, True),
    "head_dim-256-float16": ("sm_90a", {"head_dim": 256, "dtype": torch.float16}, 0.0, True,
                             None, True),
    "causal-non-square": ("sm_90a", {"seqlens": (64, 96)}, 0.0, True, None, True),
    "head_dim-80": ("sm_90a", {"head_dim": 80}, 0.0, False, None, True),
    "head_dim-8-sm80": ("sm_80", {"head_dim": 8}, 0.0, True, None, True),
    "value-narrower": ("sm_90a", {"head_dim": 192, "head_dim_v": 128}, 0.0, True, None, True),
    "value-narrower-sm80": ("sm_80", {"head_dim": 96, "head_dim_v": 64}, 0.0, False, None,
                            True),
    "head_dim-12": ("sm_90a", {"head_dim": 12}, 0.0, False, None, False),
    "head_dim-264": ("sm_90a", {"head_dim": 264}, 0.0, False, None, False),
    "value-wider": ("sm_90a", {"head_dim_v": 256}, 0.0, False, None, False),
    "value-head_dim-100": ("sm_90a", {"head_dim_v": 100}, 0.0, False, None, False),
    "key-unlike-query": ("sm_90a", {"head_dim_k": 64}, 0.0, False, None, False),
    "float32": ("sm_90a", {"dtype": torch.float32}, 0.0, False, None, False),
    "dropout": ("sm_90a", {}, 0.1, False, None, False),
    "negative-scale": ("sm_90a", {}, 0.0, False, -0.5, False),
    "infinite-scale": ("sm_90a", {}, 0.0, False, float("inf"), False),
    "empty": ("sm_90a", {"seqlens": (0, 64)}, 0.0, False, None, False),
    "gpu-without-ptxattn-kernels": (None, {}, 0.0, False, None, False),
}


@pytest.mark.parametrize("case", ELIGIBILITY)
def test_which_flash_calls_ptxattn_runs(case):
    arch, options, dropout_p, is_causal, scale, runs = ELIGIBILITY[case]
    q, k, v = _meta_qkv(**options)
    assert ptxattn.torch._ptxattn_runs(arch, q, k, v, dropout_p, is_causal, scale) is runs


def test_ptxattn_runs_no_mix_of_dtypes():
    q, k, v = _meta_qkv()
    assert not ptxattn.torch._ptxattn_runs("sm_90a", q, k.half(), v, 0.0, False, None)


@pytest.mark.parametrize("head_dim_v", [128, 64])
def test_sdpa_output_has_values_head_dim_in_the_querys_layout(head_dim_v):
    """SDPA's (batch, heads, seqlen, head_dim) views of (batch, seqlen, heads, head_dim)
    tensors: the forward's output is query's layout with value's head_dim (torch's meta
    kernel's strides when the head dims agree)."""
    query = torch.empty((2, 64, 8, 128), dtype=torch.bfloat16, device="meta").transpose(1, 2)
    value = torch.empty((2, 64, 2, head_dim_v), dtype=torch.bfloat16,
                        device="meta").transpose(1, 2)
    out = ptxattn.torch._sdpa_output(query, value)
    assert (out.shape, out.dtype) == ((2, 8, 64, head_dim_v), torch.bfloat16)
    assert out.transpose(1, 2).is_contiguous()
    if head_dim_v == 128:
        assert out.stride() == query.stride()


# ---------------------------------------------------------------------------------------------
# GPU


def _flash_only():
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return sdpa_kernel(SDPBackend.FLASH_ATTENTION)


def _torchs_backends():
    """Flash, memory-efficient and math attention, which torch tries in that order: cuDNN,
    which torch 2.11 tries first on sm_90, would take calls before the flash backend is
    offered them."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                        SDPBackend.MATH])


@contextlib.contextmanager
def _deterministic():
    """torch.use_deterministic_algorithms on (warning only, so that the other ops run as they
    are), then as it was."""
    previous = (torch.are_deterministic_algorithms_enabled(),
                torch.is_deterministic_algorithms_warn_only_enabled())
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous[0], warn_only=previous[1])


@pytest.fixture
def ptxattn_calls(monkeypatch):
    """How many forward and backward calls reach ptxattn's kernels (ptxattn.api's entry points,
    which ptxattn.torch calls)."""
    counts = {"forward": 0, "backward": 0}

    def counted(kind, entry_point):
        def call(*args, **kwargs):
            counts[kind] += 1
            return entry_point(*args, **kwargs)
        return call

    monkeypatch.setattr(ptxattn.api, "attention", counted("forward", ptxattn.api.attention))
    monkeypatch.setattr(ptxattn.api, "attention_backward",
                        counted("backward", ptxattn.api.attention_backward))
    return counts


def _sdpa(causal=False, **options):
    """An attend(q, k, v, sinks) for _autograd_step: F.scaled_dot_product_attention on
    (batch, seqlen, heads, head_dim) tensors through its (batch, heads, seqlen, head_dim)
    views."""
    import torch.nn.functional as F

    def attend(q, k, v, sinks):
        out = F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v)),
                                             is_causal=causal,
                                             enable_gqa=q.shape[2] != k.shape[2], **options)
        return out.transpose(1, 2)

    return attend


def _ptxattn(causal):
    def attend(q, k, v, sinks):
        return ptxattn.torch.attention(q, k, v, causal=causal, deterministic=True)
    return attend


def _check_against_fp32(results, q, k, v, dout, causal):
    """out, dq, dk, dv within the naive bf16 error of FP32 (bottom-right causal)."""
    def reference(q, k, v, sinks):
        return _reference_attention(q, k, v, sinks, causal=causal)

    truths = _autograd_step(reference, q, k, v, None, dout, torch.float32)
    naives = _autograd_step(reference, q, k, v, None, dout)
    _assert_within_naive_error(results, truths, naives, q.dtype)


def _assert_same_bits(results, expected):
    for name, got, want in zip(("out", "dq", "dk", "dv"), results, expected):
        assert torch.equal(got, want), name


@pytest.mark.gpu
@needs_registry
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads", [(8, 8), (8, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("head_dim", [64, 80, 128, 256])
def test_sdpa_runs_ptxattn_forward_and_backward(causal, heads, head_dim, ptxattn_calls, rng):
    heads_q, heads_kv = heads
    q, k, v, dout = _normal(rng, (2, 555, heads_q, head_dim), (2, 555, heads_kv, head_dim),
                            (2, 555, heads_kv, head_dim), (2, 555, heads_q, head_dim))
    with ptxattn.torch.sdpa_enabled(), _flash_only(), _deterministic():
        results = _autograd_step(_sdpa(causal), q, k, v, None, dout)
    assert ptxattn_calls == {"forward": 1, "backward": 1}
    _assert_same_bits(results, _autograd_step(_ptxattn(causal), q, k, v, None, dout))
    _check_against_fp32(results, q, k, v, dout, causal)


@pytest.mark.gpu
@needs_registry
def test_sdpa_runs_ptxattn_in_float16(ptxattn_calls, rng):
    q, k, v, dout = _normal(rng, (2, 300, 8, 128), (2, 300, 2, 128), (2, 300, 2, 128),
                            (2, 300, 8, 128), dtype=torch.float16)
    with ptxattn.torch.sdpa_enabled(), _flash_only(), _deterministic():
        results = _autograd_step(_sdpa(causal=True, scale=0.1), q, k, v, None, dout)
    assert ptxattn_calls == {"forward": 1, "backward": 1}

    def direct(q, k, v, sinks):
        return ptxattn.torch.attention(q, k, v, causal=True, softmax_scale=0.1,
                                       deterministic=True)

    _assert_same_bits(results, _autograd_step(direct, q, k, v, None, dout))


# Calls ptxattn cannot run: options of _torchs_call. Torch's selection gives an attn_mask, float32
# and causal attention with seqlen_q != seqlen_k (top-left aligned in SDPA) to another backend.
TORCHS_CALLS = {
    "attn_mask": {"mask": True},
    "float32": {"dtype": torch.float32},
    "causal-300x500": {"seqlens": (300, 500), "causal": True},
}


@pytest.mark.gpu
@needs_registry
@pytest.mark.parametrize("case", TORCHS_CALLS)
def test_sdpa_leaves_torch_the_calls_ptxattn_cannot_run(case, ptxattn_calls, rng):
    options = TORCHS_CALLS[case]
    seqlen_q, seqlen_k = options.get("seqlens", (300, 300))
    head_dim = options.get("head_dim", 128)
    q, k, v, dout = _normal(rng, (2, seqlen_q, 8, head_dim), (2, seqlen_k, 8, head_dim),
                            (2, seqlen_k, 8, head_dim), (2, seqlen_q, 8, head_dim),
                            dtype=options.get("dtype", torch.bfloat16))
    extra = {}
    if options.get("mask"):
        mask = torch.tensor(rng.random((seqlen_q, seqlen_k)) < 0.8, device="cuda")
        mask[:, 0] = True  # every query sees a key
        extra["attn_mask"] = mask
    attend = _sdpa(options.get("causal", False), **extra)
    with _torchs_backends():
        expected = _autograd_step(attend, q, k, v, None, dout)
        with ptxattn.torch.sdpa_enabled():
            results = _autograd_step(attend, q, k, v, None, dout)
    assert ptxattn_calls == {"forward": 0, "backward": 0}
    assert torch.equal(results[0], expected[0])
    for name, got, want in zip(("dq", "dk", "dv"), results[1:], expected[1:]):
        torch.testing.assert_close(got, want, msg=name)


@pytest.mark.gpu
@needs_registry
def test_sdpa_with_dropout_runs_on_torchs_flash_kernels(ptxattn_calls, rng):
    q, k, v, dout = _normal(rng, *[(2, 256, 8, 128)] * 4)
    with ptxattn.torch.sdpa_enabled(), _flash_only():
        out, dq, dk, dv = _autograd_step(_sdpa(dropout_p=0.25), q, k, v, None, dout)
    assert ptxattn_calls == {"forward": 0, "backward": 0}
    for x in (out, dq, dk, dv):
        assert bool(torch.isfinite(x).all())


@pytest.mark.gpu
@needs_registry
def test_flash_op_called_directly_aligns_causal_bottom_right(ptxattn_calls, rng):
    """300 queries over 500 keys, GQA: SDPA's selection refuses these to flash, the op itself
    aligns them bottom-right, FlashAttention 2 and ptxattn alike."""
    q, k, v, dout = _normal(rng, (2, 300, 8, 128), (2, 500, 2, 128), (2, 500, 2, 128),
                            (2, 300, 8, 128))

    def flash_op(q, k, v, sinks):
        out = torch.ops.aten._scaled_dot_product_flash_attention(
            *(x.transpose(1, 2) for x in (q, k, v)), 0.0, True)[0]
        return out.transpose(1, 2)

    torchs = _autograd_step(flash_op, q, k, v, None, dout)
    with ptxattn.torch.sdpa_enabled(), _deterministic():
        results = _autograd_step(flash_op, q, k, v, None, dout)
    assert ptxattn_calls == {"forward": 1, "backward": 1}
    _assert_same_bits(results, _autograd_step(_ptxattn(True), q, k, v, None, dout))
    _check_against_fp32(results, q, k, v, dout, causal=True)
    _check_against_fp32(torchs, q, k, v, dout, causal=True)


@pytest.mark.gpu
@needs_registry
def test_flash_op_called_directly_takes_narrower_value_heads(ptxattn_calls, rng):
    """q and k of head_dim 192, v of 128 (multi-head latent attention), which SDPA's selection
    never gives the flash backend: the op called directly runs ptxattn's kernels, its output of
    v's head_dim, dv of v's shape."""
    q, k, v, dout = _normal(rng, (2, 300, 8, 192), (2, 300, 2, 192), (2, 300, 2, 128),
                            (2, 300, 8, 128))

    def flash_op(q, k, v, sinks):
        out = torch.ops.aten._scaled_dot_product_flash_attention(
            *(x.transpose(1, 2) for x in (q, k, v)), 0.0, True)[0]
        return out.transpose(1, 2)

    with ptxattn.torch.sdpa_enabled(), _deterministic():
        results = _autograd_step(flash_op, q, k, v, None, dout)
    assert ptxattn_calls == {"forward": 1, "backward": 1}
    assert results[0].shape == dout.shape and results[3].shape == v.shape
    _assert_same_bits(results, _autograd_step(_ptxattn(True), q, k, v, None, dout))
    _check_against_fp32(results, q, k, v, dout, causal=True)


@pytest.mark.gpu
@needs_registry
def test_compiled_sdpa_runs_ptxattn(ptxattn_calls, rng):
    """torch.compile (inductor, no graph break) traces SDPA's flash op with torch's meta kernel
    and calls the op when it runs: ptxattn's kernels, with outputs of the meta kernel's strides."""
    q, k, v, dout = _normal(rng, (2, 500, 8, 128), (2, 500, 2, 128), (2, 500, 2, 128),
                            (2, 500, 8, 128))
    attend = _sdpa(causal=True)
    with ptxattn.torch.sdpa_enabled(), _flash_only(), _deterministic():
        eager = _autograd_step(attend, q, k, v, None, dout)
        traced = _autograd_step(torch.compile(attend, fullgraph=True), q, k, v, None, dout)
    assert ptxattn_calls == {"forward": 2, "backward": 2}
    for name, got, want in zip(("out", "dq", "dk", "dv"), traced, eager):
        torch.testing.assert_close(got, want, msg=name)


@pytest.mark.gpu
@needs_registry
def test_torchs_flash_kernel_is_back_after_the_block(ptxattn_calls, rng):
    q, k, v = _normal(rng, *[(2, 400, 8, 128)] * 3)
    attend = _sdpa(causal=True)
    assert torch.nn.attention.current_flash_attention_impl() is None
    with _flash_only():
        before = attend(q, k, v, None)
        with ptxattn.torch.sdpa_enabled():
            with ptxattn.torch.sdpa_enabled():
                pass
            inside = attend(q, k, v, None)  # after the inner block: still ptxattn's
        after = attend(q, k, v, None)
    assert ptxattn_calls["forward"] == 1
    assert torch.nn.attention.current_flash_attention_impl() is None
    assert torch.equal(after, before)
    assert torch.equal(inside, ptxattn.torch.attention(q, k, v, causal=True))
