"""ptxattn.jax: the XLA FFI adapter.

Without a GPU (JAX's CPU backend): importing ptxattn does not import JAX; the ctypes mirrors of
XLA's FFI structs have the header's field offsets (a table derived from ``xla/ffi/api/c_api.h``
of jaxlib 0.10 and 0.11 and, where a C compiler is found, the header shipped with the installed
jaxlib, whichever names it uses); the metadata query is answered with the API version XLA speaks
(a stand-in XLA_FFI_Api of each version), another major version is refused; the handler
machinery (buffers, scalar attributes, errors) runs for real on XLA's CPU runtime through test
targets, on JAX's CPU device even where a GPU is the default; bad arguments fail at trace time;
shapes, gradients' shapes, vmap and the lowered custom calls are right.

On the GPU, under jax.jit: outputs and gradients (jax.grad of a scalar loss) against FP32 attention,
``jax.nn.dot_product_attention`` on float32 copies at the highest matmul precision. Tolerance as in
tests/test_backward.py: each result's max error against FP32 is at most twice the max error of
``jax.nn.dot_product_attention`` run on the same bf16/fp16 inputs (the same math in the input
precision: FP32 logits and softmax, P rounded to the input dtype, as ptxattn does), plus twice the
rounding noise of one value of that result in the input dtype. No GPU test can hang the run
(GPU_TEST_TIMEOUT_S below).
"""

import ctypes
import faulthandler
import importlib.util
import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest

# XLA would otherwise take 75% of the GPU when it starts, and ptxattn's CuPy allocations (and the
# CuPy tests that run after these in one pytest process) would share the rest.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

requires_jax = pytest.mark.skipif(importlib.util.find_spec("jax") is None,
                                  reason="jax is not installed (pip install jax)")


def test_importing_ptxattn_does_not_import_jax():
    code = ("import sys, ptxattn, ptxattn.api, ptxattn.problem, ptxattn.dispatch; "
            "print('jax' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True)
    assert result.stdout.strip() == "False"


# ---------------------------------------------------------------------------------------------
# The C ABI

# (struct, field, offset) and (struct, size) on LP64, from c_api.h, the same in FFI API 0.3
# (jaxlib 0.10.2) and 0.4 (jaxlib 0.11.2), both checked by compiling the header with gcc: every
# field ptxattn.jax reads or writes. Names are ptxattn.jax's, which are the 0.4 header's.
C_OFFSETS = [
    ("XLA_FFI_InternalExtension", "type", 8), ("XLA_FFI_InternalExtension", "next", 16),
    ("XLA_FFI_Api_Version", "major_version", 16), ("XLA_FFI_Api_Version", "minor_version", 20),
    ("XLA_FFI_Metadata", "api_version", 8), ("XLA_FFI_Metadata", "traits", 32),
    ("XLA_FFI_Metadata_Extension", "metadata", 24),
    ("XLA_FFI_ByteSpan", "len", 8),
    ("XLA_FFI_Scalar", "value", 8),
    ("XLA_FFI_Buffer", "dtype", 16), ("XLA_FFI_Buffer", "data", 24),
    ("XLA_FFI_Buffer", "rank", 32), ("XLA_FFI_Buffer", "dims", 40),
    ("XLA_FFI_Args", "size", 16), ("XLA_FFI_Args", "types", 24), ("XLA_FFI_Args", "args", 32),
    ("XLA_FFI_Rets", "size", 16), ("XLA_FFI_Rets", "types", 24), ("XLA_FFI_Rets", "rets", 32),
    ("XLA_FFI_Attrs", "size", 16), ("XLA_FFI_Attrs", "types", 24),
    ("XLA_FFI_Attrs", "names", 32), ("XLA_FFI_Attrs", "attrs", 40),
    ("XLA_FFI_Error_Create_Args", "message", 16), ("XLA_FFI_Error_Create_Args", "errc", 24),
    ("XLA_FFI_Stream_Get_Args", "ctx", 16), ("XLA_FFI_Stream_Get_Args", "stream", 24),
    ("XLA_FFI_Api", "api_version", 16), ("XLA_FFI_Api", "internal_api", 40),
    ("XLA_FFI_Api", "XLA_FFI_Error_Create", 48), ("XLA_FFI_Api", "XLA_FFI_Stream_Get", 80),
    ("XLA_FFI_CallFrame", "api", 16), ("XLA_FFI_CallFrame", "ctx", 24),
    ("XLA_FFI_CallFrame", "stage", 32), ("XLA_FFI_CallFrame", "args", 40),
    ("XLA_FFI_CallFrame", "rets", 80), ("XLA_FFI_CallFrame", "attrs", 120),
    ("XLA_FFI_CallFrame", "future", 168),
]
C_SIZES = [("XLA_FFI_InternalExtension", 24), ("XLA_FFI_Api_Version", 24),
           ("XLA_FFI_Metadata_Extension", 32), ("XLA_FFI_ByteSpan", 16), ("XLA_FFI_Scalar", 16),
           ("XLA_FFI_Buffer", 48), ("XLA_FFI_Args", 40), ("XLA_FFI_Rets", 40),
           ("XLA_FFI_Attrs", 48), ("XLA_FFI_Error_Create_Args", 32),
           ("XLA_FFI_Stream_Get_Args", 32), ("XLA_FFI_CallFrame", 176)]
# XLA_FFI_STRUCT_SIZE(struct, last field), what the handler passes as struct_size
C_STRUCT_SIZES = [("XLA_FFI_Error_Create_Args", "errc", 28),
                  ("XLA_FFI_Stream_Get_Args", "stream", 32),
                  ("XLA_FFI_Api_Version", "minor_version", 24)]


@requires_jax
def test_struct_layouts_match_c_api_h():
    import ptxattn.jax as pj

    for struct, field, offset in C_OFFSETS:
        assert getattr(getattr(pj, struct), field).offset == offset, (struct, field)
    for struct, size in C_SIZES:
        assert ctypes.sizeof(getattr(pj, struct)) == size, struct
    for struct, last, size in C_STRUCT_SIZES:
        assert pj.struct_size(getattr(pj, struct), last) == size, struct


def _header_names(header: str) -> dict[str, str]:
    """ptxattn.jax's struct names as ``header`` (c_api.h's text) spells them: FFI API 0.4 (jaxlib
    0.11) renamed XLA_FFI_Extension_Base to XLA_FFI_InternalExtension."""
    if "XLA_FFI_InternalExtension" in header:
        return {}
    return {"XLA_FFI_InternalExtension": "XLA_FFI_Extension_Base"}


@requires_jax
def test_struct_layouts_match_the_installed_jaxlib_header(tmp_path):
    """The same offsets, sizes and XLA_FFI_STRUCT_SIZEs, printed by a C program built against the
    c_api.h that this jaxlib ships, and its major API version: a jaxlib that moved a field fails
    here."""
    import jax

    import ptxattn.jax as pj

    compiler = shutil.which("cc") or shutil.which("gcc")
    header_dir = jax.ffi.include_dir()
    header_path = os.path.join(header_dir, "xla", "ffi", "api", "c_api.h")
    if compiler is None:
        pytest.skip("no C compiler to build the layout probe")
    if not os.path.isfile(header_path):
        pytest.skip(f"this jaxlib ships no xla/ffi/api/c_api.h under {header_dir}")
    with open(header_path) as f:
        names = _header_names(f.read())

    def c(struct):
        return names.get(struct, struct)

    lines = [f'printf("{s}.{f} %zu\\n", offsetof({c(s)}, {f}));' for s, f, _ in C_OFFSETS]
    lines += [f'printf("{s} %zu\\n", sizeof({c(s)}));' for s, _ in C_SIZES]
    lines += [f'printf("XLA_FFI_STRUCT_SIZE({s}, {f}) %zu\\n", '
              f'(size_t)XLA_FFI_STRUCT_SIZE({c(s)}, {f}));' for s, f, _ in C_STRUCT_SIZES]
    lines += ['printf("XLA_FFI_API_MAJOR %d\\n", XLA_FFI_API_MAJOR);',
              'printf("XLA_FFI_API_MINOR %d\\n", XLA_FFI_API_MINOR);']
    source = tmp_path / "layout.c"
    source.write_text(textwrap.dedent("""\
        #include <stddef.h>
        #include <stdio.h>
        #include "xla/ffi/api/c_api.h"
        int main(void) {
        %s
          return 0;
        }
        """) % "\n".join(lines))
    binary = tmp_path / "layout"
    subprocess.run([compiler, f"-I{header_dir}", str(source), "-o", str(binary)], check=True)
    printed = dict(line.rsplit(" ", 1)
                   for line in subprocess.run([str(binary)], capture_output=True, text=True,
                                              check=True).stdout.splitlines())
    version = f"FFI API {printed['XLA_FFI_API_MAJOR']}.{printed['XLA_FFI_API_MINOR']}"
    assert int(printed["XLA_FFI_API_MAJOR"]) == pj.API_MAJOR, version
    for struct, field, _ in C_OFFSETS:
        assert getattr(getattr(pj, struct), field).offset == int(printed[f"{struct}.{field}"]), \
            (version, struct, field)
    for struct, _ in C_SIZES:
        assert ctypes.sizeof(getattr(pj, struct)) == int(printed[struct]), (version, struct)
    for struct, last, _ in C_STRUCT_SIZES:
        assert pj.struct_size(getattr(pj, struct), last) == int(
            printed[f"XLA_FFI_STRUCT_SIZE({struct}, {last})"]), (version, struct)


class _FakeXla:
    """What a handler uses of XLA before it runs anything, made here: an XLA_FFI_Api of a chosen
    version whose XLA_FFI_Error_Create records the error and returns a dummy address."""

    ERROR = 0xE0

    def __init__(self, version):
        import ptxattn.jax as pj

        self.errors = []

        def create(args):
            self.errors.append((args.contents.errc, args.contents.message.decode()))
            return self.ERROR

        self._create = pj.XLA_FFI_Error_Create(create)  # kept alive with the table
        self.api = pj.XLA_FFI_Api(struct_size=ctypes.sizeof(pj.XLA_FFI_Api),
                                  XLA_FFI_Error_Create=self._create)
        self.api.api_version.major_version, self.api.api_version.minor_version = version


def _metadata_frame(xla, extensions):
    """A call frame as XLA's metadata query makes it: ``extensions`` (XLA_FFI_InternalExtension
    heads, the metadata one among them) chained in order, ``xla``'s table (None: no table)."""
    import ptxattn.jax as pj

    for extension, following in zip(extensions, extensions[1:]):
        extension.next = ctypes.pointer(following)
    frame = pj.XLA_FFI_CallFrame(struct_size=ctypes.sizeof(pj.XLA_FFI_CallFrame),
                                 stage=pj.ExecutionStage.EXECUTE)
    frame.extension_start = ctypes.pointer(extensions[0])
    if xla is not None:
        frame.api = ctypes.pointer(xla.api)
    return frame


def _metadata_extension(metadata):
    import ptxattn.jax as pj

    extension = pj.XLA_FFI_Metadata_Extension(metadata=ctypes.pointer(metadata))
    extension.extension_base = pj.XLA_FFI_InternalExtension(
        struct_size=ctypes.sizeof(extension), type=pj.ExtensionType.METADATA)
    return extension


@requires_jax
@pytest.mark.parametrize("xla_version, answer", [
    ((0, 1), (0, 1)), ((0, 3), (0, 3)), ((0, 4), (0, 4)), ((0, 9), (0, 4)), (None, (0, 1))],
    ids=["0.1", "0.3-jaxlib-0.10", "0.4-jaxlib-0.11", "0.9-newer", "no-table"])
def test_metadata_query_is_answered_with_xla_s_version_and_no_traits(xla_version, answer):
    """The handler speaks XLA's API version, up to the newest declared (0.4), and says it is not
    safe to capture in a CUDA graph: ptxattn allocates workspace per call."""
    import ptxattn.jax as pj

    xla = _FakeXla(xla_version) if xla_version is not None else None
    metadata = pj.XLA_FFI_Metadata(struct_size=ctypes.sizeof(pj.XLA_FFI_Metadata), traits=7)
    extension = _metadata_extension(metadata)
    frame = _metadata_frame(xla, [extension.extension_base])
    ran = []
    handler = pj.ffi_handler("metadata_probe", ran.append)
    assert handler(ctypes.pointer(frame)) is None
    assert not ran
    version = metadata.api_version
    assert (version.major_version, version.minor_version) == answer
    assert version.struct_size == ctypes.sizeof(pj.XLA_FFI_Api_Version)
    assert metadata.traits == 0


@requires_jax
def test_metadata_extension_is_found_behind_another_one():
    import ptxattn.jax as pj

    metadata = pj.XLA_FFI_Metadata(struct_size=ctypes.sizeof(pj.XLA_FFI_Metadata))
    extension = _metadata_extension(metadata)
    other = pj.XLA_FFI_InternalExtension(struct_size=ctypes.sizeof(pj.XLA_FFI_InternalExtension),
                                         type=99)
    frame = _metadata_frame(_FakeXla((0, 4)), [other, extension.extension_base])
    ran = []
    assert pj.ffi_handler("metadata_probe", ran.append)(ctypes.pointer(frame)) is None
    assert not ran
    assert (metadata.api_version.major_version, metadata.api_version.minor_version) == (0, 4)


@requires_jax
def test_metadata_query_of_another_major_version_is_refused():
    """An XLA of FFI API 1.x may have moved every field: registration fails with the versions
    named, rather than the handler reading one struct as another."""
    import ptxattn.jax as pj

    xla = _FakeXla((1, 0))
    metadata = pj.XLA_FFI_Metadata(struct_size=ctypes.sizeof(pj.XLA_FFI_Metadata))
    extension = _metadata_extension(metadata)
    frame = _metadata_frame(xla, [extension.extension_base])
    assert pj.ffi_handler("metadata_probe", None)(ctypes.pointer(frame)) == _FakeXla.ERROR
    assert xla.errors == [(pj.ErrorCode.INVALID_ARGUMENT,
                           "metadata_probe: ValueError: XLA speaks FFI API 1.0; ptxattn.jax "
                           "declares the C ABI of 0.1 to 0.4 only")]


@requires_jax
@pytest.mark.parametrize("stage", ["INSTANTIATE", "PREPARE", "INITIALIZE", "RECORD"])
def test_a_stage_other_than_execute_is_an_error(stage):
    """Only an execute handler is registered (and no CUDA-graph trait, so no RECORD call): a call
    at another stage runs nothing and says so."""
    import ptxattn.jax as pj

    xla = _FakeXla((0, 4))
    frame = pj.XLA_FFI_CallFrame(struct_size=ctypes.sizeof(pj.XLA_FFI_CallFrame),
                                 api=ctypes.pointer(xla.api), stage=pj.ExecutionStage[stage])
    ran = []
    assert pj.ffi_handler("stage_probe", ran.append)(ctypes.pointer(frame)) == _FakeXla.ERROR
    assert not ran
    assert xla.errors == [(pj.ErrorCode.INTERNAL,
                           f"stage_probe: called at stage {pj.ExecutionStage[stage].value}; "
                           "ptxattn registers an execute handler only")]


# ---------------------------------------------------------------------------------------------
# The handler on XLA's CPU runtime: a test target that reads its float32 input buffer and scalar
# attributes and writes its output, the way the CUDA targets do with device buffers. Its inputs are
# placed on JAX's CPU device: where JAX has a GPU, that is its default device, and the test targets
# are registered for the CPU only.


_cpu_targets = {}


def _host_array(buffer, np_dtype):
    dims = tuple(buffer.dims[i] for i in range(buffer.rank))
    pointer = ctypes.cast(buffer.data, ctypes.POINTER(np.ctypeslib.as_ctypes_type(np_dtype)))
    return np.ctypeslib.as_array(pointer, dims)


def _affine_target():
    """out = x * scale + shift, or raise what the attribute ``fail`` names."""
    import ptxattn.jax as pj

    def body(call):
        attrs = call.attrs
        (x,), (out,) = call.args, call.rets
        if attrs["fail"] == 1:
            raise ValueError("the test asked for a ValueError")
        if attrs["fail"] == 2:
            raise RuntimeError("the test asked for a RuntimeError")
        _host_array(out, np.float32)[...] = (_host_array(x, np.float32) * attrs["scale"]
                                             + attrs["shift"])

    if "affine" not in _cpu_targets:
        _cpu_targets["affine"] = pj.ffi_handler("ptxattn_test_affine", body)
        pj.register("ptxattn_test_affine", _cpu_targets["affine"], platform="cpu")
    return "ptxattn_test_affine"


def _on_cpu(x):
    import jax
    return jax.device_put(x, jax.devices("cpu")[0])


def _affine(x, fail=0):
    import jax

    target = _affine_target()
    return jax.jit(lambda x: jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(x.shape, x.dtype))(
        x, scale=np.float64(0.5), shift=np.int32(3), fail=np.int64(fail),
        flag=np.bool_(True)))(_on_cpu(x))


@requires_jax
def test_handler_reads_buffers_and_attributes_on_xla_cpu():
    import jax.numpy as jnp

    x = jnp.arange(12, dtype=jnp.float32).reshape(3, 4)
    out = _affine(x)
    assert {d.platform for d in out.devices()} == {"cpu"}
    np.testing.assert_array_equal(np.asarray(out), np.asarray(x) * 0.5 + 3)


@requires_jax
@pytest.mark.parametrize("fail, code, kind", [(1, "INVALID_ARGUMENT", "ValueError"),
                                              (2, "INTERNAL", "RuntimeError")])
def test_handler_exception_becomes_an_xla_error_with_its_message(fail, code, kind):
    import jax
    import jax.numpy as jnp

    with pytest.raises(jax.errors.JaxRuntimeError, match=f"{code}: ptxattn_test_affine: {kind}: "
                                                         "the test asked for"):
        _affine(jnp.ones(4, jnp.float32), fail=fail).block_until_ready()


@requires_jax
def test_stream_request_on_cpu_passes_xla_error_on():
    """FfiCall.stream() on a runtime without one: XLA's own error comes back, not a crash."""
    import jax
    import jax.numpy as jnp

    import ptxattn.jax as pj

    if "stream" not in _cpu_targets:
        _cpu_targets["stream"] = pj.ffi_handler("ptxattn_test_stream", lambda call: call.stream())
        pj.register("ptxattn_test_stream", _cpu_targets["stream"], platform="cpu")
    x = _on_cpu(jnp.ones(4, jnp.float32))
    with pytest.raises(jax.errors.JaxRuntimeError, match="context is not available") as error:
        jax.ffi.ffi_call("ptxattn_test_stream", jax.ShapeDtypeStruct(x.shape, x.dtype))(
            x).block_until_ready()
    assert "ptxattn_test_stream:" not in str(error.value)  # XLA's error, not one made of it


# ---------------------------------------------------------------------------------------------
# Tracing


def _spec(shape, dtype="bfloat16"):
    import jax
    return jax.ShapeDtypeStruct(shape, np.dtype(dtype))


@requires_jax
@pytest.mark.parametrize("change, error, message", [
    ({"q": ((2, 128, 8, 64), "float32")}, TypeError, "q must have dtype float16 or bfloat16"),
    ({"k": ((2, 100, 2, 64), "int8")}, TypeError, "k must have dtype .* integer array"),
    ({"v": ((2, 100, 2, 64), "float16")}, TypeError, "q, k and v must share a dtype"),
    ({"q": ((2, 128, 64), "bfloat16")}, ValueError, "q must have 4 dimensions"),
    ({"q": ((2, 128, 7, 64), "bfloat16")}, ValueError, r"q's heads \(7\) must be a multiple"),
    ({"v": ((2, 99, 2, 64), "bfloat16")}, ValueError, "k and v must have the same shape"),
    ({"q": ((2, 128, 8, 96), "bfloat16"), "k": ((2, 100, 2, 96), "bfloat16"),
      "v": ((2, 100, 2, 96), "bfloat16")}, ValueError, "head_dim must be one of"),
    ({"q": ((2, 0, 8, 64), "bfloat16")}, ValueError, "q must not be empty"),
    ({"causal": 1}, TypeError, "causal must be a bool"),
    ({"softmax_scale": -1.0}, ValueError, "softmax_scale must be a finite positive number"),
    ({"deterministic": "yes"}, TypeError, "deterministic must be a bool"),
])
def test_bad_arguments_fail_at_trace_time(change, error, message):
    import jax

    import ptxattn.jax as pj

    arrays = {"q": ((2, 128, 8, 64), "bfloat16"), "k": ((2, 100, 2, 64), "bfloat16"),
              "v": ((2, 100, 2, 64), "bfloat16")}
    options = {}
    for name, value in change.items():
        (arrays if name in arrays else options)[name] = value
    specs = [_spec(*arrays[name]) for name in "qkv"]
    with pytest.raises(error, match=message):
        jax.eval_shape(lambda q, k, v: pj.attention(q, k, v, **options), *specs)


@requires_jax
def test_a_non_array_argument_is_refused_with_its_name():
    import ptxattn.jax as pj

    with pytest.raises(TypeError, match="k must be an array, got builtins.list"):
        pj.attention(_spec((1, 16, 2, 64)), [[0.0]], _spec((1, 16, 2, 64)))


@requires_jax
@pytest.mark.parametrize("causal", [False, True])
def test_shapes_of_output_gradients_and_vmap(causal):
    import jax
    import jax.numpy as jnp

    import ptxattn.jax as pj

    q, k = _spec((2, 128, 8, 64)), _spec((2, 300, 2, 64))

    def loss(q, k, v):
        return jnp.sum(pj.attention(q, k, v, causal=causal).astype(jnp.float32))

    out = jax.eval_shape(lambda q, k, v: pj.attention(q, k, v, causal=causal), q, k, k)
    assert (out.shape, out.dtype) == (q.shape, q.dtype)
    grads = jax.eval_shape(jax.grad(loss, argnums=(0, 1, 2)), q, k, k)
    assert [(g.shape, g.dtype) for g in grads] == [(x.shape, x.dtype) for x in (q, k, k)]
    batched = jax.eval_shape(jax.vmap(lambda q, k, v: pj.attention(q, k, v, causal=causal)),
                             _spec((3, *q.shape)), _spec((3, *k.shape)), _spec((3, *k.shape)))
    assert batched.shape == (3, *q.shape)


@requires_jax
def test_lowered_calls_carry_the_static_attributes():
    import jax
    import jax.numpy as jnp

    import ptxattn.jax as pj

    q, k = _spec((1, 64, 4, 128)), _spec((1, 64, 4, 128))

    def loss(q, k, v):
        return jnp.sum(pj.attention(q, k, v, causal=True, softmax_scale=0.3,
                                    deterministic=True).astype(jnp.float32))

    text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, k).as_text()
    assert "custom_call @ptxattn_attention_forward" in text
    assert "custom_call @ptxattn_attention_backward" in text
    assert "causal = true" in text and "deterministic = true" in text
    assert "softmax_scale = 3.000000e-01 : f64" in text
    # lse: float32 (batch, heads_q, seqlen_q), saved for the backward
    assert "tensor<1x4x64xf32>" in text


# ---------------------------------------------------------------------------------------------
# On the GPU


# No GPU test may hang the run. One that has not finished after GPU_TEST_TIMEOUT_S seconds
# (PTXATTN_TEST_TIMEOUT_S; kernels compiled on first use count) ends pytest, printing every thread's
# stack (faulthandler). The tests whose kernels wait on one another (the deterministic backward's
# blocks take turns, atomics.cuh) run in a child process instead, which is killed at the deadline
# while the run goes on: a kernel that never finishes cannot be stopped from inside its process.
GPU_TEST_TIMEOUT_S = float(os.environ.get("PTXATTN_TEST_TIMEOUT_S", "240"))


def _jax_with_gpu():
    jax = pytest.importorskip("jax", reason="jax is not installed (pip install jax[cuda13])")
    try:
        jax.devices("gpu")
    except RuntimeError as e:
        pytest.skip(f"JAX has no GPU backend here: {e}")
    return jax


@pytest.fixture
def jax_gpu():
    """JAX with a GPU, for a test that runs in this process, under the deadline."""
    jax = _jax_with_gpu()
    faulthandler.dump_traceback_later(GPU_TEST_TIMEOUT_S, exit=True)
    yield jax
    faulthandler.cancel_dump_traceback_later()


def _run_in_child(check, rng):
    """Runs ``check(rng)``, a function of this module, in a new Python process with a generator
    seeded from ``rng``; fails this test with the child's output if it fails, and with its stacks
    if it is still running at the deadline."""
    _jax_with_gpu()
    seed = int(rng.integers(2 ** 63))
    grace = min(30.0, GPU_TEST_TIMEOUT_S / 10)  # for the child's stacks to be printed
    code = textwrap.dedent(f"""\
        import faulthandler, importlib.util
        import numpy as np
        faulthandler.dump_traceback_later({GPU_TEST_TIMEOUT_S - grace}, exit=True)
        spec = importlib.util.spec_from_file_location("jax_adapter_checks", {__file__!r})
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        module.{check.__name__}(np.random.default_rng({seed}))
        """)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        child = subprocess.run([sys.executable, "-c", code], cwd=repo, capture_output=True,
                               text=True, timeout=GPU_TEST_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:  # its output comes as bytes, whatever text= says
        output = b"\n".join(x for x in (e.stdout, e.stderr) if x).decode(errors="replace")
        pytest.fail(f"{check.__name__} still ran after {GPU_TEST_TIMEOUT_S:.0f} s and was "
                    f"killed:\n{output}")
    if child.returncode != 0:
        timed_out = "Timeout (" in child.stderr  # faulthandler's header
        pytest.fail(f"{check.__name__} "
                    + (f"still ran after {GPU_TEST_TIMEOUT_S - grace:.0f} s; its stacks:"
                       if timed_out else f"failed (exit {child.returncode}):")
                    + f"\n{child.stdout}\n{child.stderr}")


def _bottom_right_causal_mask(seqlen_q, seqlen_k):
    rows = np.arange(seqlen_q)[:, None]
    return np.arange(seqlen_k)[None, :] <= rows + seqlen_k - seqlen_q


def _jax_nn_attention(q, k, v, causal, softmax_scale):
    import jax
    mask = _bottom_right_causal_mask(q.shape[1], k.shape[1]) if causal else None
    return jax.nn.dot_product_attention(q, k, v, scale=softmax_scale, mask=mask,
                                        implementation="xla")


def _value_and_grads(attend, q, k, v, dout, precision="default"):
    """attend's output and the gradients of sum(out * dout) in q, k, v, under jax.jit, with
    float32 matmuls at ``precision`` (jax_default_matmul_precision)."""
    import jax
    import jax.numpy as jnp

    def loss(q, k, v):
        out = attend(q, k, v)
        return jnp.sum(out.astype(jnp.float32) * dout), out

    step = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))
    with jax.default_matmul_precision(precision):
        grads, out = step(q, k, v)
    return (out, *grads)


def _assert_matches_fp32(q, k, v, dout, *, causal, softmax_scale=None, deterministic=False):
    import jax.numpy as jnp

    import ptxattn.jax as pj

    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    ours = _value_and_grads(
        lambda q, k, v: pj.attention(q, k, v, causal=causal, softmax_scale=softmax_scale,
                                     deterministic=deterministic), q, k, v, dout)
    naive = _value_and_grads(lambda q, k, v: _jax_nn_attention(q, k, v, causal, scale),
                             q, k, v, dout)
    fp32 = _value_and_grads(lambda q, k, v: _jax_nn_attention(q, k, v, causal, scale),
                            *(x.astype(jnp.float32) for x in (q, k, v)), dout,
                            precision="highest")
    for name, got, n, ref in zip(("out", "dq", "dk", "dv"), ours, naive, fp32):
        assert got.dtype == q.dtype, name
        assert bool(jnp.isfinite(got).all()), f"{name} has NaN/Inf (or was not written)"
        noise = float(jnp.abs(ref.astype(q.dtype).astype(jnp.float32) - ref).max())
        err = float(jnp.abs(got.astype(jnp.float32) - ref).max())
        naive_err = float(jnp.abs(n.astype(jnp.float32) - ref).max())
        assert err <= 2 * naive_err + 2 * noise + 1e-6, (name, err, naive_err, noise)
    return ours


def _random(rng, shape, dtype="bfloat16"):
    import jax.numpy as jnp
    return jnp.asarray(rng.standard_normal(shape, dtype=np.float32)).astype(dtype)


def _loss_weights(rng, shape, dtype="bfloat16"):
    """float32 weights of the scalar loss sum(out * weights), exact in ``dtype``: the gradient
    that reaches a 16-bit output is then the same for ours, the naive and the FP32 run."""
    import jax.numpy as jnp
    return _random(rng, shape, dtype).astype(jnp.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads_kv", [8, 2], ids=["mha", "gqa4"])
@pytest.mark.parametrize("seqlens", [(256, 256), (200, 333)], ids=lambda p: f"{p[0]}x{p[1]}")
def test_values_and_gradients_under_jit(jax_gpu, causal, head_dim, heads_kv, seqlens, rng):
    seqlen_q, seqlen_k = seqlens
    q = _random(rng, (2, seqlen_q, 8, head_dim))
    k = _random(rng, (2, seqlen_k, heads_kv, head_dim))
    v = _random(rng, (2, seqlen_k, heads_kv, head_dim))
    dout = _loss_weights(rng, (2, seqlen_q, 8, head_dim))
    _assert_matches_fp32(q, k, v, dout, causal=causal)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_float16_with_a_softmax_scale_and_non_causal_longer_queries(jax_gpu, causal, rng):
    seqlen_q = 300 if not causal else 200
    q = _random(rng, (1, seqlen_q, 4, 128), "float16")
    k = _random(rng, (1, 250, 4, 128), "float16")
    v = _random(rng, (1, 250, 4, 128), "float16")
    dout = _loss_weights(rng, (1, seqlen_q, 4, 128), "float16")
    _assert_matches_fp32(q, k, v, dout, causal=causal, softmax_scale=0.2)


def _check_deterministic_gradients_are_bitwise_reproducible(rng):
    import jax.numpy as jnp

    import ptxattn.jax as pj

    q = _random(rng, (2, 1000, 8, 128))
    k = _random(rng, (2, 1000, 2, 128))
    v = _random(rng, (2, 1000, 2, 128))
    dout = _loss_weights(rng, (2, 1000, 8, 128))
    first = _assert_matches_fp32(q, k, v, dout, causal=True, deterministic=True)
    again = _value_and_grads(lambda q, k, v: pj.attention(q, k, v, causal=True,
                                                          deterministic=True), q, k, v, dout)
    for a, b in zip(first, again):
        assert bool(jnp.all(a.view(jnp.uint16) == b.view(jnp.uint16)))


@pytest.mark.gpu
def test_deterministic_gradients_are_bitwise_reproducible(rng):
    _run_in_child(_check_deterministic_gradients_are_bitwise_reproducible, rng)


def _check_vmap_folds_into_batch(rng):
    """vmap over a leading axis gives, bit for bit, the call on the batch-flattened arrays."""
    import jax
    import jax.numpy as jnp

    import ptxattn.jax as pj

    q = _random(rng, (3, 2, 130, 4, 64))
    k = _random(rng, (3, 2, 170, 2, 64))
    v = _random(rng, (3, 2, 170, 2, 64))
    dout = _loss_weights(rng, (3, 2, 130, 4, 64))

    def attend(q, k, v):
        return pj.attention(q, k, v, causal=True, deterministic=True)

    vmapped = _value_and_grads(jax.vmap(attend), q, k, v, dout)
    flat = _value_and_grads(attend, *(x.reshape(6, *x.shape[2:]) for x in (q, k, v)),
                            dout.reshape(6, *dout.shape[2:]))
    for a, b in zip(vmapped, flat):
        assert bool(jnp.all(a.reshape(b.shape).view(jnp.uint16) == b.view(jnp.uint16)))


@pytest.mark.gpu
def test_vmap_folds_into_batch(rng):
    _run_in_child(_check_vmap_folds_into_batch, rng)
