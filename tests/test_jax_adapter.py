"""ptxattn.jax: the XLA FFI adapter.

Without a GPU (JAX's CPU backend): importing ptxattn does not import JAX; the ctypes mirrors of
XLA's FFI structs have the header's field offsets (a table derived from ``xla/ffi/api/c_api.h``
of jaxlib 0.10 and 0.11 and, where a C compiler is found, the header shipped with the installed
jaxlib, whichever names it uses); the metadata query is answered with the API version XLA speaks
(a stand-in XLA_FFI_Api of each version), another major version is refused; the handler
machinery (buffers, scalar attributes, errors) runs for real on XLA's CPU runtime through test
targets, on JAX's CPU device even where a GPU is the default; so do the four attention targets'
handlers, with host buffers for CuPy's and stand-ins for ptxattn's entry points that record their
calls (each operand and attribute reaches its parameter, vmap's instances are split where sinks
or cu_seqlens differ); bad arguments (window, softcap, sinks and the varlen ones too) fail at
trace time; shapes, gradients' shapes (dsinks, varlen), vmap and the lowered custom calls are
right, with head dims between the compiled ones and v narrower than q and k too (the output of
v's head_dim); the reference below agrees with jax.nn.dot_product_attention where both apply.

On the GPU, under jax.jit: outputs and gradients (jax.grad of a scalar loss) against FP32 attention:
``jax.nn.dot_product_attention`` for plain attention and, with a window, softcap or sinks and for
varlen and a narrower v, ``_reference_attention`` (the same math in plain jnp, per sequence for
varlen), each on float32 copies at the highest matmul precision. Tolerance as in
tests/test_backward.py: each result's max error against FP32 is at most twice the max error of
the reference run on the same bf16/fp16 inputs (the same math in the input precision: FP32
logits and softmax, P rounded to the input dtype, as ptxattn does), plus twice the rounding
noise of one value of that result in the input dtype (dsinks, float32, included). No GPU test
can hang the run (GPU_TEST_TIMEOUT_S below).
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


def _host_view(buffer, device_id, rank):
    """ptxattn.jax._cupy_view for a host buffer: a NumPy view, leading dimensions beyond ``rank``
    folded into the first."""
    import ptxattn.jax as pj

    dtype = pj.NUMPY_DTYPES[buffer.dtype]
    dims = tuple(buffer.dims[i] for i in range(buffer.rank))
    raw = (ctypes.c_byte * (int(np.prod(dims)) * dtype.itemsize)).from_address(buffer.data)
    view = np.frombuffer(raw, dtype=dtype).reshape(dims)
    return view.reshape(-1, *dims[len(dims) - rank + 1:])


class _RecordingPtxattn:
    """Stand-ins for ptxattn's four entry points that record each call's options and write
    results that name their inputs: out = q (its first head_dim_v columns, v's head dim),
    lse = the sinks (0 without), dq = dout (the same columns of it; 0 in the others), dk = k,
    dv = v, dsinks = 2 * sinks. A backward also checks that it got what its forward wrote."""

    def __init__(self):
        self.calls = []

    def _record(self, entry, q, options):
        self.calls.append((entry, q.shape, {name: value for name, value in options.items()
                                            if name not in ("out", "lse", "dq", "dk", "dv",
                                                            "dsinks")}))

    def attention(self, q, k, v, *, sinks, out, lse, **options):
        self._record("attention", q, {**options, "sinks": _copy(sinks)})
        out[...] = q[..., :out.shape[-1]]
        lse[...] = 0 if sinks is None else sinks[None, :, None]

    def attention_varlen(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                         *, sinks, out, lse, **options):
        self._record("attention_varlen", q, {
            **options, "sinks": _copy(sinks), "cu_seqlens": (cu_seqlens_q.tolist(),
                                                             cu_seqlens_k.tolist()),
            "max_seqlens": (max_seqlen_q, max_seqlen_k)})
        out[...] = q[..., :out.shape[-1]]
        lse[...] = 0 if sinks is None else sinks[:, None]

    def _gradients(self, dout, q, k, v, out, lse, sinks, dq, dk, dv, dsinks, heads_axis):
        head_dim_v = out.shape[-1]
        np.testing.assert_array_equal(out, q[..., :head_dim_v])
        written = 0 if sinks is None else np.expand_dims(
            sinks, [axis for axis in range(lse.ndim) if axis != heads_axis])
        np.testing.assert_array_equal(lse, np.broadcast_to(written, lse.shape))
        dq[...] = 0
        dq[..., :head_dim_v], dk[...], dv[...] = dout, k, v
        assert (dsinks is None) == (sinks is None), "dsinks is passed exactly with sinks"
        if sinks is not None:
            dsinks[...] = 2 * sinks

    def attention_backward(self, dout, q, k, v, out, lse, *, sinks, dq, dk, dv, dsinks,
                           **options):
        self._record("attention_backward", q, {**options, "sinks": _copy(sinks)})
        self._gradients(dout, q, k, v, out, lse, sinks, dq, dk, dv, dsinks, heads_axis=1)

    def attention_varlen_backward(self, dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                                  max_seqlen_q, max_seqlen_k, *, sinks, dq, dk, dv, dsinks,
                                  **options):
        self._record("attention_varlen_backward", q, {**options, "sinks": _copy(sinks)})
        self._gradients(dout, q, k, v, out, lse, sinks, dq, dk, dv, dsinks, heads_axis=0)


def _copy(x):
    return None if x is None else np.array(x)


@pytest.fixture
def recording_ptxattn(monkeypatch):
    """ptxattn.jax's four targets on XLA's CPU runtime, their handlers as they are, with host
    buffers for CuPy's device views, no device or stream, and _RecordingPtxattn for ptxattn's
    entry points."""
    pytest.importorskip("cupy")
    import contextlib

    import cupy

    import ptxattn
    import ptxattn.jax as pj

    recorder = _RecordingPtxattn()
    monkeypatch.setattr(pj, "_cupy_view", _host_view)
    monkeypatch.setattr(pj, "_device_of", lambda buffer: 0)
    monkeypatch.setattr(pj, "_cupy_stream", lambda address: contextlib.nullcontext())
    monkeypatch.setattr(pj.FfiCall, "stream", lambda call: 0)
    monkeypatch.setattr(cupy.cuda, "Device", lambda device_id: contextlib.nullcontext())
    for entry in ("attention", "attention_backward", "attention_varlen",
                  "attention_varlen_backward"):
        monkeypatch.setattr(ptxattn, entry, getattr(recorder, entry), raising=False)
    for target, run in ((pj.FORWARD_TARGET, pj._run_forward),
                        (pj.BACKWARD_TARGET, pj._run_backward),
                        (pj.VARLEN_FORWARD_TARGET, pj._run_varlen_forward),
                        (pj.VARLEN_BACKWARD_TARGET, pj._run_varlen_backward)):
        if target not in _cpu_targets:
            _cpu_targets[target] = pj.ffi_handler(target, run)
            pj.register(target, _cpu_targets[target], platform="cpu")
    return recorder


def _vjp_on_cpu(attend, inputs, cotangent):
    """attend(*inputs) and its VJP at ``cotangent``, under jax.jit, on JAX's CPU device."""
    import jax

    def forward_and_back(inputs, cotangent):
        out, pullback = jax.vjp(attend, *inputs)
        return out, pullback(cotangent)

    return jax.jit(forward_and_back)(*_on_cpu((inputs, cotangent)))


@requires_jax
def test_handlers_pass_xla_buffers_and_attributes_to_ptxattn(recording_ptxattn, rng):
    """The fixed-length targets' handlers on XLA's CPU runtime: each operand reaches its
    parameter, the attributes come back as ptxattn's options, the results land in the right
    outputs, and the backward gets the forward's out and lse."""
    import jax.numpy as jnp

    import ptxattn.jax as pj

    q, k, v, dout = (_random(rng, shape) for shape in ((2, 9, 4, 64), (2, 7, 2, 64),
                                                       (2, 7, 2, 64), (2, 9, 4, 64)))
    sinks = jnp.asarray(rng.standard_normal(4, dtype=np.float32))

    def attend(q, k, v, sinks):
        return pj.attention(q, k, v, causal=True, softmax_scale=0.5, window=(3, 0),
                            softcap=7.5, sinks=sinks, deterministic=True)

    out, (dq, dk, dv, dsinks) = _vjp_on_cpu(attend, (q, k, v, sinks), dout)
    for got, want in ((out, q), (dq, dout), (dk, k), (dv, v), (dsinks, 2 * sinks)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    options = {"causal": True, "softmax_scale": 0.5, "window": (3, 0), "softcap": 7.5}
    (forward, shape, forward_options), (backward, _, backward_options) = recording_ptxattn.calls
    assert (forward, shape, backward) == ("attention", q.shape, "attention_backward")
    for recorded in (forward_options, backward_options):
        np.testing.assert_array_equal(recorded.pop("sinks"), np.asarray(sinks))
    assert forward_options == options
    assert backward_options == {**options, "deterministic": True}

    recording_ptxattn.calls.clear()
    out, (dq, dk, dv) = _vjp_on_cpu(lambda q, k, v: pj.attention(q, k, v), (q, k, v), dout)
    for got, want in ((out, q), (dq, dout), (dk, k), (dv, v)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert [call[2]["sinks"] for call in recording_ptxattn.calls] == [None, None]


@requires_jax
def test_handlers_give_the_output_and_dv_vs_head_dim(recording_ptxattn, rng):
    """v narrower than q and k (head_dim_v 32 under 64): the handlers' output buffers are of v's
    head_dim, fixed length and varlen, dv of v's shape."""
    import jax.numpy as jnp

    import ptxattn.jax as pj

    q, k, v, dout = (_random(rng, shape) for shape in ((2, 9, 4, 64), (2, 7, 2, 64),
                                                       (2, 7, 2, 32), (2, 9, 4, 32)))
    out, (dq, dk, dv) = _vjp_on_cpu(lambda q, k, v: pj.attention(q, k, v), (q, k, v), dout)
    padded_dout = jnp.pad(dout, ((0, 0), (0, 0), (0, 0), (0, 32)))
    for got, want in ((out, q[..., :32]), (dq, padded_dout), (dk, k), (dv, v)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))

    packed_q, packed_k, packed_v = (_random(rng, shape) for shape in ((71, 4, 64), (91, 2, 64),
                                                                      (91, 2, 32)))

    def varlen(q, k, v):
        return pj.attention_varlen(q, k, v, _cu_seqlens(VARLEN_LENGTHS_Q),
                                   _cu_seqlens(VARLEN_LENGTHS_K), 70, 90, causal=True)

    out, (dq, dk, dv) = _vjp_on_cpu(varlen, (packed_q, packed_k, packed_v), packed_q[..., :32])
    for got, want in ((out, packed_q[..., :32]), (dk, packed_k), (dv, packed_v)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert dq.shape == packed_q.shape


@requires_jax
def test_handlers_split_vmap_instances_where_sinks_or_cu_seqlens_differ(recording_ptxattn,
                                                                         rng):
    """Under vmap a fixed-length call without sinks is one call over the folded batch; with
    sinks, and for varlen always, each instance is a call of its own with its own rows of sinks
    and cu_seqlens, and the cu_seqlens' contents are not checked (no synchronization)."""
    import jax
    import jax.numpy as jnp

    import ptxattn.jax as pj

    q, k, dout = (_random(rng, shape) for shape in ((3, 2, 9, 4, 64), (3, 2, 7, 2, 64),
                                                    (3, 2, 9, 4, 64)))
    sinks = jnp.asarray(rng.standard_normal((3, 4), dtype=np.float32))
    out, (dq, dk, dv, dsinks) = _vjp_on_cpu(
        jax.vmap(lambda q, k, v, sinks: pj.attention(q, k, v, sinks=sinks)), (q, k, -k, sinks),
        dout)
    for got, want in ((out, q), (dq, dout), (dk, k), (dv, -k), (dsinks, 2 * sinks)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    calls = recording_ptxattn.calls
    assert [(entry, shape) for entry, shape, _ in calls] == (
        [("attention", (2, 9, 4, 64))] * 3 + [("attention_backward", (2, 9, 4, 64))] * 3)
    for i in range(3):
        np.testing.assert_array_equal(calls[i][2]["sinks"], np.asarray(sinks[i]))

    recording_ptxattn.calls.clear()
    _vjp_on_cpu(jax.vmap(lambda q, k, v: pj.attention(q, k, v)), (q, k, k), dout)
    assert [(entry, shape) for entry, shape, _ in recording_ptxattn.calls] == [
        ("attention", (6, 9, 4, 64)), ("attention_backward", (6, 9, 4, 64))]

    recording_ptxattn.calls.clear()
    packed_q, packed_k = _random(rng, (2, 71, 4, 64)), _random(rng, (2, 91, 2, 64))
    cu_seqlens_q = np.stack([_cu_seqlens(VARLEN_LENGTHS_Q), _cu_seqlens((1, 0, 70))])
    cu_seqlens_k = np.stack([_cu_seqlens(VARLEN_LENGTHS_K), _cu_seqlens((91, 0, 0))])

    def varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, sinks):
        return pj.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, 70, 91, causal=True,
                                   window=(5, 0), sinks=sinks)

    out, (dq, dk, dv, _, _, dsinks) = _vjp_on_cpu(
        jax.vmap(varlen), (packed_q, packed_k, -packed_k, jnp.asarray(cu_seqlens_q),
                           jnp.asarray(cu_seqlens_k), sinks[:2]), packed_q)
    for got, want in ((out, packed_q), (dq, packed_q), (dk, packed_k), (dv, -packed_k),
                      (dsinks, 2 * sinks[:2])):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    forwards = [call for call in recording_ptxattn.calls if call[0] == "attention_varlen"]
    assert [shape for _, shape, _ in forwards] == [(71, 4, 64)] * 2
    for i, (_, _, options) in enumerate(forwards):
        np.testing.assert_array_equal(options.pop("sinks"), np.asarray(sinks[i]))
        assert options == {"causal": True, "softmax_scale": 0.125, "window": (5, 0),
                           "softcap": 0.0, "check_contents": False, "max_seqlens": (70, 91),
                           "cu_seqlens": (cu_seqlens_q[i].tolist(), cu_seqlens_k[i].tolist())}
    assert [call[2]["check_contents"] for call in recording_ptxattn.calls
            if call[0] == "attention_varlen_backward"] == [False, False]


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
    ({"q": ((2, 128, 8, 264), "bfloat16"), "k": ((2, 100, 2, 264), "bfloat16"),
      "v": ((2, 100, 2, 264), "bfloat16")}, ValueError,
     "head_dim must be a multiple of 8 from 8 to 256 for bfloat16 inputs, got 264"),
    ({"v": ((2, 100, 2, 128), "bfloat16")}, ValueError,
     r"v's head_dim \(head_dim_v\) must be at most head_dim \(64\)"),
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
@pytest.mark.parametrize("head_dims", [(96, 96), (192, 128), (64, 32)],
                         ids=lambda dims: "-".join(map(str, dims)))
def test_shapes_with_head_dims_between_the_compiled_ones_and_narrower_values(head_dims):
    """The output has v's head_dim (head_dim_v), the gradients their inputs' shapes, fixed
    length, varlen and under vmap; the lowered forward returns the output of v's head_dim."""
    import jax
    import jax.numpy as jnp

    import ptxattn.jax as pj

    head_dim, head_dim_v = head_dims
    q, k, v = (_spec((2, 128, 8, head_dim)), _spec((2, 300, 2, head_dim)),
               _spec((2, 300, 2, head_dim_v)))

    def loss(q, k, v):
        return jnp.sum(pj.attention(q, k, v, causal=True).astype(jnp.float32))

    out = jax.eval_shape(lambda q, k, v: pj.attention(q, k, v, causal=True), q, k, v)
    assert (out.shape, out.dtype) == ((2, 128, 8, head_dim_v), q.dtype)
    grads = jax.eval_shape(jax.grad(loss, argnums=(0, 1, 2)), q, k, v)
    assert [g.shape for g in grads] == [x.shape for x in (q, k, v)]
    batched = jax.eval_shape(jax.vmap(lambda q, k, v: pj.attention(q, k, v)),
                             *(_spec((3, *x.shape)) for x in (q, k, v)))
    assert batched.shape == (3, 2, 128, 8, head_dim_v)
    text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v).as_text()
    assert f"-> (tensor<2x128x8x{head_dim_v}xbf16>, tensor<2x8x128xf32>)" in text

    packed_q, packed_k, packed_v = (_spec((71, 8, head_dim)), _spec((91, 2, head_dim)),
                                    _spec((91, 2, head_dim_v)))

    def varlen(q, k, v):
        return pj.attention_varlen(q, k, v, _cu_seqlens(VARLEN_LENGTHS_Q),
                                   _cu_seqlens(VARLEN_LENGTHS_K), 70, 90, causal=True)

    out = jax.eval_shape(varlen, packed_q, packed_k, packed_v)
    assert out.shape == (71, 8, head_dim_v)
    grads = jax.eval_shape(
        jax.grad(lambda q, k, v: jnp.sum(varlen(q, k, v).astype(jnp.float32)),
                 argnums=(0, 1, 2)), packed_q, packed_k, packed_v)
    assert [g.shape for g in grads] == [x.shape for x in (packed_q, packed_k, packed_v)]


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


@requires_jax
@pytest.mark.parametrize("options, sinks, error, message", [
    ({"window": (8,)}, None, ValueError, r"window must be a pair \(left, right\)"),
    ({"window": (-2, 0)}, None, ValueError, "window must be a pair"),
    ({"softcap": -1.0}, None, ValueError, "softcap must be a finite number >= 0"),
    ({}, ((8,), "float16"), TypeError, "sinks must have dtype float32"),
    ({}, ((2,), "float32"), ValueError, r"sinks must have shape \(heads_q,\) = \(8,\)"),
])
def test_bad_window_softcap_or_sinks_fail_at_trace_time(options, sinks, error, message):
    import jax

    import ptxattn.jax as pj

    q, k = _spec((2, 128, 8, 64)), _spec((2, 100, 2, 64))
    sinks = _spec(*sinks) if sinks is not None else None
    with pytest.raises(error, match=message):
        jax.eval_shape(lambda q, k, v, sinks: pj.attention(q, k, v, sinks=sinks, **options),
                       q, k, k, sinks)


# A packed batch of three sequences of 0, 1 and 70 queries over 0, 1 and 90 keys: an empty
# sequence, a one-token one and a longer one.
VARLEN_LENGTHS_Q = (0, 1, 70)
VARLEN_LENGTHS_K = (0, 1, 90)


def _cu_seqlens(lengths):
    """The int32 cumulative lengths of ``lengths``, from 0."""
    return np.cumsum([0, *lengths]).astype(np.int32)


@requires_jax
@pytest.mark.parametrize("change, error, message", [
    ({"q": ((1, 71, 8, 64), "bfloat16")}, ValueError, "q must have 3 dimensions"),
    ({"cu_seqlens_q": ((4,), "float32")}, TypeError, "cu_seqlens_q must have dtype int32"),
    ({"cu_seqlens_k": ((5,), "int32")}, ValueError, "cu_seqlens_q and cu_seqlens_k must both"),
    ({"max_seqlen_q": -1}, ValueError, "max_seqlen_q must be a non-negative int"),
    ({"max_seqlen_k": 90.0}, ValueError, "max_seqlen_k must be a non-negative int"),
    ({"sinks": ((4,), "float32")}, ValueError, r"sinks must have shape \(heads_q,\) = \(8,\)"),
    ({"window": (1, 2, 3)}, ValueError, "window must be a pair"),
    ({"deterministic": 0}, TypeError, "deterministic must be a bool"),
])
def test_bad_varlen_arguments_fail_at_trace_time(change, error, message):
    import jax

    import ptxattn.jax as pj

    arrays = {"q": ((71, 8, 64), "bfloat16"), "k": ((91, 2, 64), "bfloat16"),
              "v": ((91, 2, 64), "bfloat16"), "cu_seqlens_q": ((4,), "int32"),
              "cu_seqlens_k": ((4,), "int32")}
    sizes = {"max_seqlen_q": 70, "max_seqlen_k": 90}
    options = {}
    for name, value in change.items():
        (arrays if name in arrays or name == "sinks" else
         sizes if name in sizes else options)[name] = value
    specs = {name: _spec(*spec) for name, spec in arrays.items()}

    def attend(q, k, v, cu_seqlens_q, cu_seqlens_k, sinks=None):
        return pj.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, sizes["max_seqlen_q"],
                                   sizes["max_seqlen_k"], sinks=sinks, **options)

    with pytest.raises(error, match=message):
        jax.eval_shape(attend, **specs)


@requires_jax
def test_shapes_of_gradients_with_sinks_and_of_varlen_and_vmap():
    """dsinks is float32 (heads_q,); the integer cu_seqlens get no gradient; vmap over
    per-instance sinks and over packed batches keeps the instance axis."""
    import jax
    import jax.numpy as jnp

    import ptxattn.jax as pj

    q, k, sinks = _spec((2, 128, 8, 64)), _spec((2, 300, 2, 64)), _spec((8,), "float32")

    def loss(q, k, v, sinks):
        out = pj.attention(q, k, v, causal=True, window=(64, 0), softcap=5.0, sinks=sinks)
        return jnp.sum(out.astype(jnp.float32))

    grads = jax.eval_shape(jax.grad(loss, argnums=(0, 1, 2, 3)), q, k, k, sinks)
    assert [(g.shape, g.dtype) for g in grads] == [(x.shape, x.dtype) for x in (q, k, k, sinks)]
    batched = jax.eval_shape(jax.vmap(lambda q, k, v, sinks: pj.attention(q, k, v, sinks=sinks)),
                             _spec((3, *q.shape)), _spec((3, *k.shape)), _spec((3, *k.shape)),
                             _spec((3, 8), "float32"))
    assert batched.shape == (3, *q.shape)

    packed_q, packed_k = _spec((71, 8, 64)), _spec((91, 2, 64))
    cu_seqlens_q = _cu_seqlens(VARLEN_LENGTHS_Q)
    cu_seqlens_k = _cu_seqlens(VARLEN_LENGTHS_K)

    def varlen(q, k, v, sinks):
        return pj.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, 70, 90, causal=True,
                                   sinks=sinks)

    def varlen_loss(q, k, v, sinks):
        return jnp.sum(varlen(q, k, v, sinks).astype(jnp.float32))

    out = jax.eval_shape(varlen, packed_q, packed_k, packed_k, sinks)
    assert (out.shape, out.dtype) == (packed_q.shape, packed_q.dtype)
    grads = jax.eval_shape(jax.grad(varlen_loss, argnums=(0, 1, 2, 3)), packed_q, packed_k,
                           packed_k, sinks)
    assert [(g.shape, g.dtype) for g in grads] == [
        (x.shape, x.dtype) for x in (packed_q, packed_k, packed_k, sinks)]
    grads = jax.eval_shape(jax.vmap(jax.grad(varlen_loss, argnums=(0, 3)),
                                    in_axes=(0, 0, 0, None)),
                           _spec((3, *packed_q.shape)), _spec((3, *packed_k.shape)),
                           _spec((3, *packed_k.shape)), sinks)
    assert [g.shape for g in grads] == [(3, *packed_q.shape), (3, 8)]


@requires_jax
def test_lowered_calls_carry_window_softcap_sinks_and_max_seqlens():
    import jax
    import jax.numpy as jnp

    import ptxattn.jax as pj

    q, k, sinks = _spec((1, 64, 4, 128)), _spec((1, 80, 2, 128)), _spec((4,), "float32")

    def loss(q, k, v, sinks):
        return jnp.sum(pj.attention(q, k, v, causal=True, window=(32, 0), softcap=7.5,
                                    sinks=sinks).astype(jnp.float32))

    text = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).lower(q, k, k, sinks).as_text()
    assert "custom_call @ptxattn_attention_forward" in text
    assert "custom_call @ptxattn_attention_backward" in text
    assert "window_left = 32 : i64" in text and "window_right = 0 : i64" in text
    assert "softcap = 7.500000e+00 : f64" in text
    # the backward takes the sinks after lse and returns dsinks, float32 (heads_q,), last
    assert "tensor<1x4x64xf32>, tensor<4xf32>) -> (tensor<1x64x4x128xbf16>" in text
    assert "tensor<1x80x2x128xbf16>, tensor<4xf32>)" in text

    packed_q, packed_k = _spec((71, 4, 128)), _spec((91, 2, 128))
    cu_seqlens_q = _cu_seqlens(VARLEN_LENGTHS_Q)
    cu_seqlens_k = _cu_seqlens(VARLEN_LENGTHS_K)

    def varlen_loss(q, k, v):
        return jnp.sum(pj.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, 70, 90,
                                           window=(16, 8), deterministic=True
                                           ).astype(jnp.float32))

    text = jax.jit(jax.grad(varlen_loss, argnums=(0, 1, 2))).lower(
        packed_q, packed_k, packed_k).as_text()
    assert "custom_call @ptxattn_attention_varlen_forward" in text
    assert "custom_call @ptxattn_attention_varlen_backward" in text
    assert "max_seqlen_q = 70 : i64" in text and "max_seqlen_k = 90 : i64" in text
    assert "window_left = 16 : i64" in text and "window_right = 8 : i64" in text
    assert "deterministic = true" in text and "softcap = 0.000000e+00 : f64" in text
    # lse: float32 (heads_q, total_q)
    assert "tensor<4x71xf32>" in text


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


def _visible_keys(seqlen_q, seqlen_k, causal, window=(-1, -1)):
    """(seqlen_q, seqlen_k) bool, bottom-right aligned: query i sees key j iff
    j <= i + seqlen_k - seqlen_q + right (right 0 when causal, -1 unbounded) and
    j >= i + seqlen_k - seqlen_q - left (-1 unbounded)."""
    left, right = window
    right = 0 if causal else right
    diagonal = np.arange(seqlen_q)[:, None] + seqlen_k - seqlen_q
    keys = np.arange(seqlen_k)[None, :]
    visible = np.ones((seqlen_q, seqlen_k), dtype=bool)
    if right >= 0:
        visible &= keys <= diagonal + right
    if left >= 0:
        visible &= keys >= diagonal - left
    return visible


def _jax_nn_attention(q, k, v, causal, softmax_scale):
    import jax
    mask = _visible_keys(q.shape[1], k.shape[1], causal=True) if causal else None
    return jax.nn.dot_product_attention(q, k, v, scale=softmax_scale, mask=mask,
                                        implementation="xla")


def _reference_attention(q, k, v, sinks=None, *, causal=False, softmax_scale=None,
                         window=(-1, -1), softcap=0.0):
    """ptxattn.jax.attention's math in plain jnp, computed as jax.nn.dot_product_attention
    computes it: logits and softmax in float32, the probabilities rounded to v's dtype for the
    product with v, the output in q's dtype (float32 inputs: FP32 attention). The scores are
    softmax_scale * q k^T, then softcap * tanh(s / softcap); keys that _visible_keys hides are
    masked; exp(sinks[h]) joins each row's denominator; a row that sees nothing gives 0."""
    import jax
    import jax.numpy as jnp

    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    group = q.shape[2] // k.shape[2]
    k, v = (jnp.repeat(x, group, axis=2) for x in (k, v))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) * scale
    if softcap > 0:
        scores = softcap * jnp.tanh(scores / softcap)
    scores = jnp.where(_visible_keys(q.shape[1], k.shape[1], causal, window), scores, -jnp.inf)
    row_max = scores.max(axis=-1, keepdims=True, initial=-jnp.inf)
    if sinks is not None:
        sink = sinks[None, :, None, None]
        row_max = jnp.maximum(row_max, sink)
    # The shift cancels in the softmax: no gradient through it (nor a NaN from a masked row).
    shift = jax.lax.stop_gradient(jnp.where(jnp.isfinite(row_max), row_max, 0.0))
    weights = jnp.exp(scores - shift)
    denominator = weights.sum(axis=-1, keepdims=True)
    if sinks is not None:
        denominator = denominator + jnp.exp(sink - shift)
    probs = weights / jnp.where(denominator > 0, denominator, 1.0)
    out = jnp.einsum("bhqk,bkhd->bqhd", probs.astype(v.dtype), v,
                     preferred_element_type=jnp.float32)
    return out.astype(q.dtype)


def _reference_varlen(q, k, v, sinks, lengths_q, lengths_k, **options):
    """_reference_attention over each sequence of a packed batch (``lengths_q`` and
    ``lengths_k`` on the host), its rows packed back."""
    import jax.numpy as jnp

    starts_q, starts_k = _cu_seqlens(lengths_q), _cu_seqlens(lengths_k)
    rows = [_reference_attention(q[None, starts_q[b]:starts_q[b + 1]],
                                 k[None, starts_k[b]:starts_k[b + 1]],
                                 v[None, starts_k[b]:starts_k[b + 1]], sinks, **options)[0]
            for b in range(len(lengths_q)) if lengths_q[b]]
    return jnp.concatenate(rows)


def _value_and_grads(attend, inputs, dout, precision="default"):
    """attend(*inputs) and the gradients of sum(out * dout) in every input, under jax.jit, with
    float32 matmuls at ``precision`` (jax_default_matmul_precision)."""
    import jax
    import jax.numpy as jnp

    def loss(*inputs):
        out = attend(*inputs)
        return jnp.sum(out.astype(jnp.float32) * dout), out

    step = jax.jit(jax.grad(loss, argnums=tuple(range(len(inputs))), has_aux=True))
    with jax.default_matmul_precision(precision):
        grads, out = step(*inputs)
    return (out, *grads)


def _assert_close_to_fp32(ours, reference, inputs, dout):
    """ours(*inputs) and its gradients (dq, dk, dv, then dsinks where ``inputs`` hold sinks)
    against ``reference`` on float32 copies at the highest matmul precision, by the rule of the
    module docstring: the naive error is ``reference``'s on the 16-bit inputs themselves. Returns
    ours."""
    import jax.numpy as jnp

    dtype = inputs[0].dtype
    got = _value_and_grads(ours, inputs, dout)
    naive = _value_and_grads(reference, inputs, dout)
    fp32 = _value_and_grads(reference, [x.astype(jnp.float32) for x in inputs], dout,
                            precision="highest")
    names = ("out", "dq", "dk", "dv", "dsinks")
    for name, result, like, n, ref in zip(names, got, (inputs[0], *inputs), naive, fp32):
        assert result.dtype == like.dtype, name
        assert bool(jnp.isfinite(result).all()), f"{name} has NaN/Inf (or was not written)"
        noise = float(jnp.abs(ref.astype(dtype).astype(jnp.float32) - ref).max())
        err = float(jnp.abs(result.astype(jnp.float32) - ref).max())
        naive_err = float(jnp.abs(n.astype(jnp.float32) - ref).max())
        assert err <= 2 * naive_err + 2 * noise + 1e-6, (name, err, naive_err, noise)
    return got


def _assert_matches_fp32(q, k, v, dout, *, causal, softmax_scale=None, deterministic=False):
    """_assert_close_to_fp32 of plain attention, with jax.nn.dot_product_attention as the
    reference."""
    import ptxattn.jax as pj

    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    return _assert_close_to_fp32(
        lambda q, k, v: pj.attention(q, k, v, causal=causal, softmax_scale=softmax_scale,
                                     deterministic=deterministic),
        lambda q, k, v: _jax_nn_attention(q, k, v, causal, scale), (q, k, v), dout)


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
@pytest.mark.parametrize("head_dims", [(96, 96), (192, 128), (64, 32)],
                         ids=lambda dims: "-".join(map(str, dims)))
def test_values_and_gradients_of_narrower_values_under_jit(jax_gpu, head_dims, rng):
    """Head dims between the compiled ones and v narrower than q and k, causal GQA 8/2: the
    output of v's head_dim and every gradient against FP32 through _reference_attention
    (jax.nn.dot_product_attention takes no narrower v)."""
    import ptxattn.jax as pj

    head_dim, head_dim_v = head_dims
    q = _random(rng, (2, 200, 8, head_dim))
    k = _random(rng, (2, 333, 2, head_dim))
    v = _random(rng, (2, 333, 2, head_dim_v))
    dout = _loss_weights(rng, (2, 200, 8, head_dim_v))
    out, *_ = _assert_close_to_fp32(lambda q, k, v: pj.attention(q, k, v, causal=True),
                                    lambda q, k, v: _reference_attention(q, k, v, causal=True),
                                    (q, k, v), dout)
    assert out.shape == dout.shape


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
                                                          deterministic=True), (q, k, v), dout)
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

    vmapped = _value_and_grads(jax.vmap(attend), (q, k, v), dout)
    flat = _value_and_grads(attend, [x.reshape(6, *x.shape[2:]) for x in (q, k, v)],
                            dout.reshape(6, *dout.shape[2:]))
    for a, b in zip(vmapped, flat):
        assert bool(jnp.all(a.reshape(b.shape).view(jnp.uint16) == b.view(jnp.uint16)))


@pytest.mark.gpu
def test_vmap_folds_into_batch(rng):
    _run_in_child(_check_vmap_folds_into_batch, rng)


@requires_jax
def test_reference_attention_matches_jax_nn_with_the_sinks_as_one_more_key(rng):
    """The reference of the GPU tests against jax.nn.dot_product_attention, float32 at the
    highest precision (on any device): the window as jax.nn's mask, each head's sink as one more
    key of value 0 whose logit is the sink (a bias). With 12 queries over 9 keys, causal, the
    first 3 rows see only the sink. Values and gradients, dsinks included, agree."""
    import jax
    import jax.numpy as jnp

    q = _random(rng, (2, 12, 4, 16), "float32")
    k = _random(rng, (2, 9, 2, 16), "float32")
    v = _random(rng, (2, 9, 2, 16), "float32")
    sinks = _sink_logits(rng, 4)
    dout = _loss_weights(rng, q.shape, "float32")
    options = {"causal": True, "window": (4, 0), "softmax_scale": 0.3}
    visible = _visible_keys(12, 9, options["causal"], options["window"])

    def jax_nn(q, k, v, sinks):
        k, v = (jnp.concatenate([jnp.repeat(x, 2, axis=2), jnp.zeros((2, 1, 4, 16))], axis=1)
                for x in (k, v))
        keys_bias = jnp.where(visible, 0.0, -jnp.inf)[None, None]
        sink_bias = jnp.broadcast_to(sinks[None, :, None, None], (1, 4, 12, 1))
        bias = jnp.concatenate([jnp.broadcast_to(keys_bias, (1, 4, 12, 9)), sink_bias], axis=-1)
        return jax.nn.dot_product_attention(q, k, v, bias=bias, scale=options["softmax_scale"],
                                            implementation="xla")

    ours = _value_and_grads(lambda q, k, v, sinks: _reference_attention(q, k, v, sinks,
                                                                        **options),
                            (q, k, v, sinks), dout, precision="highest")
    theirs = _value_and_grads(jax_nn, (q, k, v, sinks), dout, precision="highest")
    for name, a, b in zip(("out", "dq", "dk", "dv", "dsinks"), ours, theirs):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5,
                                   err_msg=name)
    assert not np.asarray(ours[0][:, :3]).any()


def _sink_logits(rng, heads_q):
    """float32 sinks from 2 to 5: exp(sink) is then a visible share of a row's denominator
    (each visible key adds about e^0.5 for these random inputs), so that the sinks and their
    gradient matter."""
    import jax.numpy as jnp
    return jnp.asarray(rng.uniform(2.0, 5.0, heads_q).astype(np.float32))


def _attend_and_reference(rng, heads_q, options, deterministic=False):
    """ptxattn.jax.attention and _reference_attention with ``options`` (``sinks=True``: random
    sinks, an input of both), and their inputs beyond q, k and v."""
    import ptxattn.jax as pj

    options = dict(options)
    with_sinks = options.pop("sinks", False)

    def attend(q, k, v, sinks=None):
        return pj.attention(q, k, v, sinks=sinks, deterministic=deterministic, **options)

    def reference(q, k, v, sinks=None):
        return _reference_attention(q, k, v, sinks, **options)

    return attend, reference, (_sink_logits(rng, heads_q),) if with_sinks else ()


FIXED_LENGTH_OPTIONS = [
    pytest.param({"causal": True, "window": (48, 0)}, id="causal-window"),
    pytest.param({"window": (40, 24)}, id="two-sided-window"),
    pytest.param({"causal": True, "softcap": 2.0}, id="softcap"),
    pytest.param({"sinks": True}, id="sinks"),
    pytest.param({"causal": True, "window": (64, 0), "softcap": 3.0, "sinks": True}, id="all"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("options", FIXED_LENGTH_OPTIONS)
@pytest.mark.parametrize("seqlens", [(160, 230), (200, 150)], ids=lambda p: f"{p[0]}x{p[1]}")
def test_window_softcap_and_sinks_values_and_gradients(jax_gpu, options, seqlens, rng):
    """Against FP32 autograd of _reference_attention, dsinks included. With 200 queries over
    150 keys the first rows see no key when causal or under the two-sided window."""
    seqlen_q, seqlen_k = seqlens
    q = _random(rng, (2, seqlen_q, 8, 128))
    k = _random(rng, (2, seqlen_k, 2, 128))
    v = _random(rng, (2, seqlen_k, 2, 128))
    dout = _loss_weights(rng, q.shape)
    attend, reference, sinks = _attend_and_reference(rng, 8, options)
    _assert_close_to_fp32(attend, reference, (q, k, v, *sinks), dout)


VARLEN_OPTIONS = [
    pytest.param({"causal": True}, id="causal"),
    pytest.param({"causal": True, "window": (32, 0), "softcap": 3.0, "sinks": True},
                 id="causal-window-softcap-sinks"),
    pytest.param({"window": (16, 8), "sinks": True}, id="two-sided-window-sinks"),
]


def _varlen_attend_and_reference(rng, heads_q, options, deterministic=False):
    """ptxattn.jax.attention_varlen over the VARLEN_LENGTHS batch and _reference_varlen, with
    ``options`` as in _attend_and_reference, and their inputs beyond q, k and v."""
    import jax.numpy as jnp

    import ptxattn.jax as pj

    options = dict(options)
    with_sinks = options.pop("sinks", False)
    cu_seqlens_q = jnp.asarray(_cu_seqlens(VARLEN_LENGTHS_Q))
    cu_seqlens_k = jnp.asarray(_cu_seqlens(VARLEN_LENGTHS_K))

    def attend(q, k, v, sinks=None):
        return pj.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max(VARLEN_LENGTHS_Q),
                                   max(VARLEN_LENGTHS_K), sinks=sinks,
                                   deterministic=deterministic, **options)

    def reference(q, k, v, sinks=None):
        return _reference_varlen(q, k, v, sinks, VARLEN_LENGTHS_Q, VARLEN_LENGTHS_K, **options)

    return attend, reference, (_sink_logits(rng, heads_q),) if with_sinks else ()


def _packed_inputs(rng, heads_q=8, heads_kv=2, head_dim=64):
    """q, k, v and the loss weights of the VARLEN_LENGTHS batch."""
    q = _random(rng, (sum(VARLEN_LENGTHS_Q), heads_q, head_dim))
    k = _random(rng, (sum(VARLEN_LENGTHS_K), heads_kv, head_dim))
    v = _random(rng, (sum(VARLEN_LENGTHS_K), heads_kv, head_dim))
    return q, k, v, _loss_weights(rng, q.shape)


@pytest.mark.gpu
@pytest.mark.parametrize("options", VARLEN_OPTIONS)
def test_varlen_values_and_gradients(jax_gpu, options, rng):
    """An empty, a one-token and a longer sequence, packed: values and gradients against FP32
    autograd of _reference_attention per sequence."""
    q, k, v, dout = _packed_inputs(rng)
    attend, reference, sinks = _varlen_attend_and_reference(rng, 8, options)
    _assert_close_to_fp32(attend, reference, (q, k, v, *sinks), dout)


def _same_bits(a, b) -> bool:
    return np.asarray(a).tobytes() == np.asarray(b).tobytes()


def _check_deterministic_gradients_with_window_softcap_and_sinks(rng):
    """deterministic=True with every option on: gradients (dsinks too) bit-identical from run
    to run, fixed-length and varlen, and close to FP32."""
    options = {"causal": True, "window": (96, 0), "softcap": 3.0, "sinks": True}
    q = _random(rng, (2, 600, 8, 128))
    k = _random(rng, (2, 600, 2, 128))
    v = _random(rng, (2, 600, 2, 128))
    dout = _loss_weights(rng, q.shape)
    attend, reference, sinks = _attend_and_reference(rng, 8, options, deterministic=True)
    first = _assert_close_to_fp32(attend, reference, (q, k, v, *sinks), dout)
    again = _value_and_grads(attend, (q, k, v, *sinks), dout)
    assert all(_same_bits(a, b) for a, b in zip(first, again))

    q, k, v, dout = _packed_inputs(rng)
    attend, reference, sinks = _varlen_attend_and_reference(rng, 8, options, deterministic=True)
    first = _assert_close_to_fp32(attend, reference, (q, k, v, *sinks), dout)
    again = _value_and_grads(attend, (q, k, v, *sinks), dout)
    assert all(_same_bits(a, b) for a, b in zip(first, again))


@pytest.mark.gpu
def test_deterministic_gradients_with_window_softcap_and_sinks(rng):
    _run_in_child(_check_deterministic_gradients_with_window_softcap_and_sinks, rng)


def _check_vmap_gives_each_instance_its_sinks_and_packed_batch(rng):
    """vmap over per-instance sinks, and over packed batches, gives bit for bit what each
    instance's own call gives, gradients included."""
    import jax
    import jax.numpy as jnp

    import ptxattn.jax as pj

    q = _random(rng, (3, 2, 130, 4, 64))
    k = _random(rng, (3, 2, 170, 2, 64))
    v = _random(rng, (3, 2, 170, 2, 64))
    sinks = jnp.stack([_sink_logits(rng, 4) for _ in range(3)])
    dout = _loss_weights(rng, q.shape)

    def attend(q, k, v, sinks):
        return pj.attention(q, k, v, causal=True, window=(32, 0), sinks=sinks,
                            deterministic=True)

    vmapped = _value_and_grads(jax.vmap(attend), (q, k, v, sinks), dout)
    for i in range(3):
        single = _value_and_grads(attend, (q[i], k[i], v[i], sinks[i]), dout[i])
        assert all(_same_bits(a[i], b) for a, b in zip(vmapped, single)), i

    packed = [jnp.stack(x) for x in zip(*(_packed_inputs(rng, 4) for _ in range(2)))]
    attend_varlen, _, varlen_sinks = _varlen_attend_and_reference(
        rng, 4, {"causal": True, "sinks": True}, deterministic=True)
    vmapped = _value_and_grads(jax.vmap(attend_varlen, in_axes=(0, 0, 0, None)),
                               (*packed[:3], *varlen_sinks), packed[3])
    singles = [_value_and_grads(attend_varlen, (*(x[i] for x in packed[:3]), *varlen_sinks),
                                packed[3][i]) for i in range(2)]
    for i, single in enumerate(singles):
        for name, a, b in zip(("out", "dq", "dk", "dv"), vmapped, single):
            assert _same_bits(a[i], b), (name, i)
    # The sinks, shared by the instances, get the sum of the instances' gradients.
    np.testing.assert_allclose(np.asarray(vmapped[4]),
                               np.asarray(singles[0][4] + singles[1][4]), rtol=1e-6)


@pytest.mark.gpu
def test_vmap_gives_each_instance_its_sinks_and_packed_batch(rng):
    _run_in_child(_check_vmap_gives_each_instance_its_sinks_and_packed_batch, rng)
