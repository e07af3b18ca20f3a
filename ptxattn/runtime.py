"""Run-time compilation, caching, loading and launching of CUDA kernels from ``ptx_src/``.

Nothing here knows about attention. A kernel variant is described by a :class:`KernelSpec`
(source file, entry point, ``-D`` defines, dynamic shared memory); the entry point may be a
template instantiation such as ``ns::kernel<128, true>``, which NVRTC instantiates from the
source through a name expression, so a variant needs no generated source. :func:`compile` turns it into
a CUBIN for an architecture with NVRTC (no GPU needed), :func:`load` puts it on the current CuPy
device, and :func:`launch` runs it on CuPy's current stream through ``cuLaunchKernelEx``.

CUBINs are cached on disk under ``$PTXATTN_CACHE_DIR`` (``~`` and ``$VARS`` expanded; default
``$XDG_CACHE_HOME/ptxattn`` or ``~/.cache/ptxattn``), keyed by the text of the source and of
every header it includes, the options, the arch and the NVRTC version, and not by where ptxattn
is installed, so every install on a machine (or an image) shares the entries. An entry is named
by that key (``<key>.cubin``), and ``index.tsv`` beside them names the kernel of each. Each entry
carries a SHA-256 of its payload, so a truncated or corrupt entry is detected and rebuilt rather
than loaded. Processes that want the same missing entry take turns on a per-entry file lock,
removed once the entry is published, so it is compiled once. Where the directory cannot be
written, compiled kernels stay in memory, with one :class:`CacheWarning`.
"""

from __future__ import annotations

import collections
import ctypes
import dataclasses
import functools
import hashlib
import json
import os
import re
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Callable, Mapping, Sequence

import numpy as np

try:
    import fcntl
except ImportError:  # Windows has no flock: processes racing on a missing entry may each compile it
    fcntl = None


def _source_dir() -> Path:
    # A wheel installs the kernel sources inside the package; a checkout keeps them beside it.
    installed = Path(__file__).resolve().parent / "ptx_src"
    return installed if installed.is_dir() else Path(__file__).resolve().parent.parent / "ptx_src"


SOURCE_DIR = _source_dir()

_CACHE_MAGIC = b"PTXATTN-CUBIN-2\n"


class PtxattnError(RuntimeError):
    """Base class of the errors ptxattn raises at run time."""


class CompileError(PtxattnError):
    """NVRTC rejected a kernel; ``log`` holds the compiler's output."""

    def __init__(self, kernel: str, arch: str, log: str):
        super().__init__(f"NVRTC failed to compile kernel {kernel!r} for {arch}:\n{log}")
        self.kernel = kernel
        self.arch = arch
        self.log = log


class CudaError(PtxattnError):
    """A CUDA driver call failed, or there is no driver recent enough to make one."""


class CacheWarning(UserWarning):
    """The compile cache directory cannot be written: kernels are compiled into memory only."""


@dataclasses.dataclass(frozen=True)
class KernelSpec:
    """One compile-time variant of a kernel: everything that determines its binary.

    ``source`` is a file under SOURCE_DIR (``kernels/fwd_sm90.cu``), or the absolute path of one
    elsewhere (a test's probe kernel), whose own folder is then searched for its includes before
    SOURCE_DIR. ``entry`` is the kernel's name, or a name expression instantiating a ``__global__``
    function template (``ns::kernel<Config<128, 2>>``): NVRTC instantiates it and reports the
    lowered (mangled) symbol, which is what is loaded."""

    name: str
    source: str
    entry: str
    defines: Mapping[str, int | str] = dataclasses.field(default_factory=dict)
    smem_bytes: int = 0
    archs: tuple[str, ...] = ("sm_80", "sm_90a", "sm_120a")

    def __hash__(self) -> int:
        return hash((self.name, self.source, self.entry, tuple(sorted(self.defines.items())),
                     self.smem_bytes, self.archs))

    @property
    def is_template(self) -> bool:
        return "<" in self.entry

    def options(self, arch: str) -> list[str]:
        """The NVRTC options that shape the binary. The include directory is not among them:
        it says only where the headers are (their text goes into the cache key), and is added
        by the compile call."""
        opts = [f"--gpu-architecture={arch}", "-std=c++17", "--ptxas-options=-v",
                "-DPTXATTN_ARCH=" + arch.removeprefix("sm_").rstrip("a")]
        opts += [f"-D{key}={value}" for key, value in sorted(self.defines.items())]
        return opts


def template_arguments(config) -> str:
    """A dataclass's fields in declared order as C++ template arguments (``128, 64, true``):
    how every launcher writes the name expression of a kernel whose configuration it mirrors.
    Fields hold ints and bools."""
    values = []
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if isinstance(value, bool):
            values.append("true" if value else "false")
        elif isinstance(value, int):
            values.append(str(value))
        else:
            raise TypeError(f"{type(config).__name__}.{field.name} must be an int or a bool to "
                            f"be a template argument, got {value!r}")
    return ", ".join(values)


@dataclasses.dataclass(frozen=True)
class PtxasReport:
    """What ptxas said about the entry function: the numbers budgets are checked against."""

    registers: int
    spill_stores: int
    spill_loads: int
    static_smem: int
    stack_bytes: int

    @classmethod
    def parse(cls, log: str, entry: str) -> "PtxasReport | None":
        """The entry's numbers, or None when this NVRTC left ptxas's report out of its log
        (NVRTC 13.0 does; 13.5 does not)."""
        # ptxas prints one "Function properties for <entry>" block per function; take ours.
        start = log.find(f"Function properties for {entry}")
        if start < 0:
            return None
        section = log[start:]
        nxt = section.find("Function properties for", 1)
        section = section if nxt < 0 else section[:nxt]

        def number(pattern: str) -> int:
            match = re.search(pattern, section)
            return int(match.group(1)) if match else 0

        return cls(
            registers=number(r"Used (\d+) registers"),
            spill_stores=number(r"(\d+) bytes spill stores"),
            spill_loads=number(r"(\d+) bytes spill loads"),
            static_smem=number(r"(\d+) bytes smem"),
            stack_bytes=number(r"(\d+) bytes stack frame"),
        )


@dataclasses.dataclass(frozen=True)
class CompiledKernel:
    spec: KernelSpec
    arch: str
    cubin: bytes
    report: PtxasReport | None
    log: str
    symbol: str = ""  # the entry's lowered name in the cubin (spec.entry when not a template)

    @property
    def spill_bytes(self) -> int:
        return self.reported().spill_stores + self.reported().spill_loads

    @property
    def smem_bytes(self) -> int:
        return self.reported().static_smem + self.spec.smem_bytes

    def reported(self) -> PtxasReport:
        if self.report is None:
            raise PtxattnError(f"NVRTC {nvrtc_version()} gave no ptxas report for "
                               f"{self.spec.name}; budgets need an NVRTC that does (13.5 does)")
        return self.report


def _nvrtc():
    from cuda.bindings import nvrtc
    return nvrtc


def nvrtc_version() -> tuple[int, int]:
    nvrtc = _nvrtc()
    err, major, minor = nvrtc.nvrtcVersion()
    _check_nvrtc(err, "nvrtcVersion")
    return major, minor


def _check_nvrtc(err, what: str) -> None:
    if int(err) != 0:
        raise PtxattnError(f"{what} failed: {err}")


_INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.MULTILINE)


def _include_roots(source: str) -> list[Path]:
    """Where the includes of ``source`` are found: SOURCE_DIR, and for a source outside it (given
    by its absolute path: a test's probe kernel) that source's own folder first."""
    path = Path(source)
    return [path.parent, SOURCE_DIR] if path.is_absolute() else [SOURCE_DIR]


def _include_tree(source: str) -> list[tuple[str, str]]:
    """The source file and every header it includes (transitively), as (name, text) pairs."""
    roots = _include_roots(source)
    seen: dict[str, str] = {}
    pending = [source]
    while pending:
        name = pending.pop()
        if name in seen:
            continue
        path = next((root / name for root in roots if (root / name).is_file()), None)
        if path is None:
            raise PtxattnError(f"kernel source {name!r} not found in "
                               f"{', '.join(map(str, roots))}")
        text = path.read_text()
        seen[name] = text
        pending.extend(_INCLUDE.findall(text))
    return sorted(seen.items())


def cache_dir() -> Path:
    root = os.environ.get("PTXATTN_CACHE_DIR")
    if root:
        return _expanded(root)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (_expanded(xdg) if xdg else Path.home() / ".cache") / "ptxattn"


def _expanded(path: str) -> Path:
    return Path(os.path.expanduser(os.path.expandvars(path)))


def cache_key(spec: KernelSpec, arch: str) -> str:
    """The cache entry's name (``<key>.cubin``; INDEX_FILE says which kernel each is): a hash
    of the text of the source and of every header it includes, the entry, the options and the
    NVRTC version. No path is in it, so installs at different paths share entries."""
    digest = hashlib.sha256()
    for name, text in _include_tree(spec.source):
        name = Path(name).name if Path(name).is_absolute() else name
        digest.update(name.encode() + b"\0" + text.encode() + b"\0")
    digest.update(spec.entry.encode() + b"\0")
    digest.update("\0".join(spec.options(arch)).encode())
    digest.update(repr(nvrtc_version()).encode())
    return digest.hexdigest()[:40]


def _read_cache_entry(path: Path) -> tuple[bytes, str, str] | None:
    """(cubin, log, symbol) from a cache file, or None if it is missing, truncated or
    corrupt."""
    try:
        blob = path.read_bytes()
    except OSError:
        return None
    if not blob.startswith(_CACHE_MAGIC):
        return None
    header_end = blob.find(b"\n", len(_CACHE_MAGIC))
    if header_end < 0:
        return None
    try:
        header = json.loads(blob[len(_CACHE_MAGIC):header_end])
        payload = blob[header_end + 1:]
        if len(payload) != header["size"] or hashlib.sha256(payload).hexdigest() != header["sha256"]:
            return None
        log_len = header["log_size"]
        return payload[log_len:], payload[:log_len].decode(), header["symbol"]
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        return None


def _write_cache_entry(path: Path, cubin: bytes, log: str, symbol: str) -> None:
    log_bytes = log.encode()
    payload = log_bytes + cubin
    header = json.dumps({"size": len(payload), "log_size": len(log_bytes), "symbol": symbol,
                         "sha256": hashlib.sha256(payload).hexdigest()}).encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    # Publish atomically so a concurrent reader sees either nothing or a whole entry.
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(_CACHE_MAGIC + header + b"\n" + payload)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _include_options(source: str = "") -> list[str]:
    # Headers come from _include_roots only: by default NVRTC looks in the current directory
    # first, where a file named like one of ours would be compiled in unseen by the cache key.
    return [f"-I{root}" for root in _include_roots(source)] + ["--no-source-include"]


def _nvrtc_compile(spec: KernelSpec, arch: str) -> tuple[bytes, str, str]:
    nvrtc = _nvrtc()
    text = (SOURCE_DIR / spec.source).read_text()
    err, prog = nvrtc.nvrtcCreateProgram(text.encode(), spec.source.encode(), 0, [], [])
    _check_nvrtc(err, "nvrtcCreateProgram")
    try:
        if spec.is_template:
            (err,) = nvrtc.nvrtcAddNameExpression(prog, spec.entry.encode())
            _check_nvrtc(err, f"nvrtcAddNameExpression({spec.entry})")
        opts = [o.encode() for o in spec.options(arch) + _include_options(spec.source)]
        (result,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        err, size = nvrtc.nvrtcGetProgramLogSize(prog)
        _check_nvrtc(err, "nvrtcGetProgramLogSize")
        # NVRTC writes into the buffer: a bytearray, never bytes, which CPython shares (b" " * 1
        # is the one b" " of the whole process).
        log = bytearray(size)
        (err,) = nvrtc.nvrtcGetProgramLog(prog, log)
        log_text = log.rstrip(b"\0 ").decode(errors="replace")
        if int(result) != 0:
            raise CompileError(spec.name, arch, log_text)
        err, size = nvrtc.nvrtcGetCUBINSize(prog)
        _check_nvrtc(err, "nvrtcGetCUBINSize")
        cubin = bytearray(size)
        (err,) = nvrtc.nvrtcGetCUBIN(prog, cubin)
        _check_nvrtc(err, "nvrtcGetCUBIN")
        symbol = spec.entry
        if spec.is_template:
            err, lowered = nvrtc.nvrtcGetLoweredName(prog, spec.entry.encode())
            _check_nvrtc(err, f"nvrtcGetLoweredName({spec.entry})")
            symbol = lowered.decode()
        return bytes(cubin), log_text, symbol
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def check_source(text: str, name: str, arch: str) -> None:
    """Compiles CUDA source text against ptx_src's headers for ``arch`` (no GPU needed), raising
    CompileError with NVRTC's log if it does not compile: for static checks, such as a layout
    that host code mirrors."""
    nvrtc = _nvrtc()
    err, prog = nvrtc.nvrtcCreateProgram(text.encode(), name.encode(), 0, [], [])
    _check_nvrtc(err, "nvrtcCreateProgram")
    try:
        opts = [o.encode() for o in [f"--gpu-architecture={arch}", "-std=c++17",
                                     *_include_options()]]
        (result,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        if int(result) != 0:
            err, size = nvrtc.nvrtcGetProgramLogSize(prog)
            log = bytearray(size)
            nvrtc.nvrtcGetProgramLog(prog, log)
            raise CompileError(name, arch, log.rstrip(b"\0 ").decode(errors="replace"))
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


# Kernels compiled or read in this process; also the only cache where the disk cannot be written.
_compiled: dict[tuple[KernelSpec, str], CompiledKernel] = {}
_lock = threading.Lock()
# Where this process got kernels from beyond _compiled: "nvrtc" (compiled) and "disk" (read from
# the cache), counted for `python -m ptxattn kernels --warm`'s report and the tests.
compile_counts: collections.Counter[str] = collections.Counter()
# Cache directories a lock or write failed in (warned about once): not tried again.
_unwritable_dirs: set[Path] = set()


def compile(spec: KernelSpec, arch: str) -> CompiledKernel:  # noqa: A001 - the natural name
    """CUBIN and ptxas report of ``spec`` for ``arch``, from memory, disk cache or NVRTC."""
    if arch not in spec.archs:
        raise PtxattnError(f"kernel {spec.name!r} is not built for {arch} (only {spec.archs})")
    with _lock:
        hit = _compiled.get((spec, arch))
    if hit is not None:
        return hit
    cubin, log, symbol = _from_disk_or_nvrtc(spec, arch)
    compiled = CompiledKernel(spec, arch, cubin, PtxasReport.parse(log, symbol), log, symbol)
    with _lock:
        _compiled[(spec, arch)] = compiled
    return compiled


def _from_disk_or_nvrtc(spec: KernelSpec, arch: str) -> tuple[bytes, str, str]:
    """(cubin, log, symbol) from the disk cache, or compiled and published there. A miss is
    compiled under the entry's file lock, so that of N processes wanting it one compiles and
    the others read what it published."""
    root = cache_dir()
    key = cache_key(spec, arch)
    path = root / (key + ".cubin")
    entry = _read_cache_entry(path)
    if entry is not None:
        _count("disk")
        return entry
    with _lock:
        writable = root not in _unwritable_dirs
    if not writable:
        return _counted_nvrtc_compile(spec, arch)
    try:
        lock_fd = _lock_entry(path)
    except OSError as err:
        _keep_in_memory(root, err)
        return _counted_nvrtc_compile(spec, arch)
    try:
        entry = _read_cache_entry(path)  # published while this process waited for the lock
        if entry is not None:
            _count("disk")
            return entry
        entry = _counted_nvrtc_compile(spec, arch)
        try:
            _write_cache_entry(path, *entry)
            _index_entry(root, key, spec, arch)
        except OSError as err:
            _keep_in_memory(root, err)
        return entry
    finally:
        _unlock_entry(path, lock_fd)


def _counted_nvrtc_compile(spec: KernelSpec, arch: str) -> tuple[bytes, str, str]:
    entry = _nvrtc_compile(spec, arch)
    _count("nvrtc")
    return entry


def _count(source: str) -> None:
    with _lock:
        compile_counts[source] += 1


def _lock_entry(path: Path) -> int:
    """An open descriptor of ``path``'s lock file (``<key>.lock`` beside it), holding an
    exclusive flock on it: closing it releases the lock."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path.with_suffix(".lock"), os.O_RDWR | os.O_CREAT, 0o666)
    if fcntl is not None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except BaseException:
            os.close(fd)
            raise
    return fd


def _unlock_entry(path: Path, fd: int) -> None:
    """Removes ``path``'s lock file, then releases the lock. A process still waiting on the
    removed file, and one that makes a new lock file from here on, each reads the entry once it
    holds its lock: the entry was published before the file went, so it is compiled once."""
    path.with_suffix(".lock").unlink(missing_ok=True)
    os.close(fd)


# Beside the entries: one line per entry published, "<key>\t<arch>\t<variant>\t<entry>", for
# a person (or `python -m ptxattn doctor`) to see what the hashed names hold.
INDEX_FILE = "index.tsv"


def _index_entry(root: Path, key: str, spec: KernelSpec, arch: str) -> None:
    # one write of a line opened for appending: concurrent writers' lines do not interleave
    line = f"{key}\t{arch}\t{spec.name}\t{spec.entry}\n".encode()
    fd = os.open(root / INDEX_FILE, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def _keep_in_memory(root: Path, err: OSError) -> None:
    """Stops using ``root`` for writes in this process, with one warning per directory."""
    with _lock:
        if root in _unwritable_dirs:
            return
        _unwritable_dirs.add(root)
    warnings.warn(f"ptxattn cannot write its compile cache in {root} ({err}); kernels compiled "
                  "by this process are kept in memory only. Point PTXATTN_CACHE_DIR at a "
                  "writable directory to keep them across runs.", CacheWarning, stacklevel=4)


# ---------------------------------------------------------------------------------------------
# Device side: everything below needs a GPU.


def _driver():
    from cuda.bindings import driver
    return driver


def _check(result, what: str):
    """Unwraps a cuda.bindings (err, *values) tuple, raising CudaError on failure."""
    err, *values = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        driver = _driver()
        _, name = driver.cuGetErrorName(err)
        raise CudaError(f"{what} failed: {name.decode() if name else err}")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


# ptxattn runs on CUDA 13 (cupy-cuda13x, cuda-bindings 13, NVRTC 13): a driver that speaks CUDA
# 13.0 (cuDriverGetVersion 13000) or later, which is driver 580 or newer.
MIN_DRIVER_CUDA_VERSION = 13000
MIN_DRIVER = 580


@functools.cache
def check_driver() -> int:
    """The CUDA version the installed driver supports (cuDriverGetVersion: 13000 is 13.0).
    Raises CudaError saying what to install when there is no NVIDIA driver or it is older than
    CUDA 13 needs: every way onto the GPU comes through here first, so that is what the user
    reads rather than CuPy's "insufficient driver" or a failed library search."""
    driver = _driver()
    try:
        result = driver.cuDriverGetVersion()
    except RuntimeError as err:  # cuda.bindings found no libcuda to load
        raise CudaError(f"no NVIDIA driver found ({err}). ptxattn needs an NVIDIA GPU with "
                        f"driver {MIN_DRIVER} or newer (CUDA 13).") from err
    version = _check(result, "cuDriverGetVersion")
    if version < MIN_DRIVER_CUDA_VERSION:
        raise CudaError(
            f"the installed NVIDIA driver supports CUDA {cuda_version_text(version)}, but "
            f"ptxattn runs on CUDA 13 (cupy-cuda13x, cuda-bindings 13, NVRTC 13), which needs "
            f"a driver for CUDA {cuda_version_text(MIN_DRIVER_CUDA_VERSION)} or later: install "
            f"NVIDIA driver {MIN_DRIVER} or newer.")
    return version


def cuda_version_text(version: int) -> str:
    """13000 -> "13.0": a CUDA version as cuDriverGetVersion and cudaRuntimeGetVersion give it."""
    return f"{version // 1000}.{version % 1000 // 10}"


def device_arch(device_id: int | None = None) -> str:
    """The compile target of a CuPy device (default: the current one)."""
    import cupy
    check_driver()
    return _arch_of_device(cupy.cuda.runtime.getDevice() if device_id is None else device_id)


@functools.cache
def sm_count(device_id: int) -> int:
    """How many multiprocessors a CuPy device has."""
    import cupy
    return cupy.cuda.runtime.deviceGetAttribute(
        cupy.cuda.runtime.cudaDevAttrMultiProcessorCount, device_id)


@functools.lru_cache(maxsize=None)
def _arch_of_device(device_id: int) -> str:
    import cupy
    from .archs import arch_for_capability  # the architecture facts live in one module

    major, minor = (int(c) for c in cupy.cuda.Device(device_id).compute_capability)
    return arch_for_capability(major, minor)


def _ensure_context() -> None:
    """Makes CuPy's device's primary context current for the driver API calls."""
    import cupy
    driver = _driver()
    _check(driver.cuInit(0), "cuInit")
    device_id = cupy.cuda.runtime.getDevice()
    ctx = _check(driver.cuCtxGetCurrent(), "cuCtxGetCurrent")
    if ctx is None or int(ctx) == 0:
        primary = _check(driver.cuDevicePrimaryCtxRetain(device_id), "cuDevicePrimaryCtxRetain")
        _check(driver.cuCtxSetCurrent(primary), "cuCtxSetCurrent")


@dataclasses.dataclass
class LoadedKernel:
    compiled: CompiledKernel
    module: object
    function: object
    device_id: int

    @property
    def spec(self) -> KernelSpec:
        return self.compiled.spec


_loaded: dict[tuple[KernelSpec, int], LoadedKernel] = {}


def load(spec: KernelSpec) -> LoadedKernel:
    """``spec`` compiled for, and loaded on, the current CuPy device."""
    import cupy
    check_driver()
    device_id = cupy.cuda.runtime.getDevice()
    key = (spec, device_id)
    with _lock:
        hit = _loaded.get(key)
    if hit is not None:
        return hit
    compiled = compile(spec, device_arch(device_id))
    _ensure_context()
    driver = _driver()
    module = _check(driver.cuModuleLoadData(compiled.cubin), f"cuModuleLoadData({spec.name})")
    function = _check(driver.cuModuleGetFunction(module, compiled.symbol.encode()),
                      f"cuModuleGetFunction({spec.entry})")
    if spec.smem_bytes > 48 * 1024:
        attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        _check(driver.cuFuncSetAttribute(function, attr, spec.smem_bytes),
               f"raising the dynamic shared memory of {spec.name} to {spec.smem_bytes} bytes")
    loaded = LoadedKernel(compiled, module, function, device_id)
    with _lock:
        _loaded[key] = loaded
    return loaded


class TensorMap:
    """A CUtensorMap (TMA descriptor) to pass by value as a ``__grid_constant__`` parameter.

    Keeps the array it describes alive, since the descriptor holds its raw address.
    """

    def __init__(self, raw: bytes, array):
        self._buffer = (ctypes.c_ubyte * 128).from_buffer_copy(raw)
        self.array = array

    @property
    def address(self) -> int:
        return ctypes.addressof(self._buffer)


_TMA_DTYPES = {
    "float16": "CU_TENSOR_MAP_DATA_TYPE_FLOAT16",
    "bfloat16": "CU_TENSOR_MAP_DATA_TYPE_BFLOAT16",
    "float32": "CU_TENSOR_MAP_DATA_TYPE_FLOAT32",
    "uint8": "CU_TENSOR_MAP_DATA_TYPE_UINT8",
    "int8": "CU_TENSOR_MAP_DATA_TYPE_UINT8",
}

_TMA_SWIZZLES = {0: "CU_TENSOR_MAP_SWIZZLE_NONE", 32: "CU_TENSOR_MAP_SWIZZLE_32B",
                 64: "CU_TENSOR_MAP_SWIZZLE_64B", 128: "CU_TENSOR_MAP_SWIZZLE_128B"}


# Encoded descriptors by everything they encode. A descriptor holds only an address and a
# layout, so it stays right for any array later placed at that address with that layout.
_tensor_maps: collections.OrderedDict[tuple, bytes] = collections.OrderedDict()
_TENSOR_MAP_CACHE_SIZE = 512


def tensor_map(array, box: Sequence[int], swizzle: int = 128, oob_zero: bool = True) -> TensorMap:
    """A tiled TMA descriptor over a CuPy array view.

    ``box`` is given in the array's own dimension order (outermost first); the descriptor's
    dimensions are the array's reversed, so kernel coordinates are innermost first.
    """
    key = (array.data.ptr, str(array.dtype), array.shape, array.strides, tuple(box), swizzle,
           oob_zero, array.device.id)
    with _lock:
        raw = _tensor_maps.get(key)
        if raw is not None:
            _tensor_maps.move_to_end(key)
    if raw is None:
        raw = _encode_tensor_map(array, box, swizzle, oob_zero)
        with _lock:
            _tensor_maps[key] = raw
            if len(_tensor_maps) > _TENSOR_MAP_CACHE_SIZE:
                _tensor_maps.popitem(last=False)
    return TensorMap(raw, array)


def _encode_tensor_map(array, box: Sequence[int], swizzle: int, oob_zero: bool) -> bytes:
    driver = _driver()
    dtype = str(array.dtype)
    if dtype not in _TMA_DTYPES:
        raise TypeError(f"tensor_map: unsupported dtype {dtype}; expected one of {sorted(_TMA_DTYPES)}")
    if swizzle not in _TMA_SWIZZLES:
        raise ValueError(f"tensor_map: swizzle must be one of {sorted(_TMA_SWIZZLES)}, got {swizzle}")
    if len(box) != array.ndim or not 1 <= array.ndim <= 5:
        raise ValueError(f"tensor_map: box {tuple(box)} must have one entry per dimension of "
                         f"the {array.ndim}-d array (1 to 5 dimensions)")
    item = array.dtype.itemsize
    if array.strides[-1] != item:
        raise ValueError("tensor_map: the innermost dimension must have unit stride")
    if array.data.ptr % 16:
        raise ValueError("tensor_map: the array's base address must be 16-byte aligned")
    # A dimension of extent 1 is never stepped over, so its stride (0 for a broadcast new axis)
    # is replaced by one the driver accepts.
    array_strides = list(array.strides)
    for i in range(array.ndim - 2, -1, -1):
        if array.shape[i] == 1:
            array_strides[i] = array_strides[i + 1] * array.shape[i + 1]
    if any(s % 16 or s <= 0 for s in array_strides[:-1]):
        raise ValueError(f"tensor_map: strides {array.strides} must be positive multiples of 16 bytes")
    if any(not 1 <= b <= 256 for b in box):
        raise ValueError(f"tensor_map: box entries must be in [1, 256], got {tuple(box)}")
    if swizzle and box[-1] * item > swizzle:
        raise ValueError(f"tensor_map: inner box of {box[-1] * item} bytes exceeds the "
                         f"{swizzle}-byte swizzle span")
    dims = [driver.cuuint64_t(int(n)) for n in reversed(array.shape)]
    strides = [driver.cuuint64_t(int(s)) for s in reversed(array_strides[:-1])]
    boxes = [driver.cuuint32_t(int(b)) for b in reversed(box)]
    ones = [driver.cuuint32_t(1)] * array.ndim
    fill = (driver.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
    if not oob_zero:
        fill = driver.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NAN_REQUEST_ZERO_FMA
    raw = _check(driver.cuTensorMapEncodeTiled(
        getattr(driver.CUtensorMapDataType, _TMA_DTYPES[dtype]), array.ndim, array.data.ptr,
        dims, strides, boxes, ones,
        driver.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
        getattr(driver.CUtensorMapSwizzle, _TMA_SWIZZLES[swizzle]),
        driver.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B, fill),
        "cuTensorMapEncodeTiled")
    return ctypes.string_at(raw.getPtr(), 128)


def _argument(value) -> ctypes._SimpleCData | ctypes.Array:
    import cupy
    if isinstance(value, cupy.ndarray):
        return ctypes.c_uint64(value.data.ptr)
    if isinstance(value, TensorMap):  # a copy: the prepared launch must not keep the array alive
        return (ctypes.c_ubyte * 128).from_buffer_copy(value._buffer)
    if isinstance(value, np.generic):
        return (ctypes.c_ubyte * value.nbytes).from_buffer_copy(value.tobytes())
    if isinstance(value, ctypes.Structure):  # a params struct, passed by value (copied)
        return (ctypes.c_ubyte * ctypes.sizeof(value)).from_buffer_copy(value)
    raise TypeError(f"kernel argument of type {type(value).__name__} is not supported: pass a "
                    "cupy.ndarray, a TensorMap, a ctypes.Structure or a NumPy scalar such as "
                    "np.int32(...)")


class PreparedLaunch:
    """A kernel launch with its arguments packed once: calling it only enqueues the kernel on
    the stream it was prepared for. It keeps the arguments' values (addresses, descriptor
    bytes, scalars), not the arrays, so a cache of these keeps no array alive."""

    def __init__(self, kernel: LoadedKernel, grid: Sequence[int], block: Sequence[int],
                 args: Sequence, smem_bytes: int | None = None, stream=None):
        import cupy
        driver = _driver()
        smem = kernel.spec.smem_bytes if smem_bytes is None else smem_bytes
        self._holders = [_argument(a) for a in args]
        self._pointers = (ctypes.c_void_p * max(len(self._holders), 1))(
            *[ctypes.addressof(h) for h in self._holders])
        stream = cupy.cuda.get_current_stream() if stream is None else stream
        config = driver.CUlaunchConfig()
        config.gridDimX, config.gridDimY, config.gridDimZ = (int(g) for g in _dim3(grid))
        config.blockDimX, config.blockDimY, config.blockDimZ = (int(b) for b in _dim3(block))
        config.sharedMemBytes = int(smem)
        config.hStream = driver.CUstream(stream.ptr)
        config.numAttrs = 0
        self._config = config
        self._kernel = kernel
        self.grid = tuple(int(g) for g in _dim3(grid))

    def __call__(self) -> None:
        _check(_driver().cuLaunchKernelEx(self._config, self._kernel.function,
                                          ctypes.addressof(self._pointers), 0),
               f"launching {self._kernel.spec.name}")


def launch(kernel: LoadedKernel, grid: Sequence[int], block: Sequence[int], args: Sequence,
           smem_bytes: int | None = None, stream=None) -> None:
    """Launches ``kernel`` with cuLaunchKernelEx on ``stream`` (default: CuPy's current one)."""
    PreparedLaunch(kernel, grid, block, args, smem_bytes, stream)()


def array_key(x) -> tuple:
    """What a prepared launch depends on of a CuPy array: its address and layout."""
    return (x.data.ptr, x.shape, x.strides, x.dtype.char)


def launch_key(arrays: Sequence, *args) -> tuple:
    """A LaunchCache key for a launch over ``arrays`` (CuPy arrays on one device) with the
    hashable ``args``: the arrays' array_key, the args, the device and CuPy's current stream."""
    import cupy
    return (tuple(array_key(x) for x in arrays), args, arrays[0].device.id,
            cupy.cuda.get_current_stream().ptr)


class LaunchCache:
    """Prepared launches under keys the caller builds (from array_key, scalars and the current
    stream), least recently used dropped first: a repeated call with the same arrays skips
    everything but the enqueue."""

    def __init__(self, size: int = 256):
        self._entries: collections.OrderedDict[tuple, PreparedLaunch] = collections.OrderedDict()
        self._size = size

    def get(self, key: tuple, build: Callable[[], PreparedLaunch]) -> PreparedLaunch:
        with _lock:
            hit = self._entries.get(key)
            if hit is not None:
                self._entries.move_to_end(key)
                return hit
        prepared = build()
        with _lock:
            self._entries[key] = prepared
            if len(self._entries) > self._size:
                self._entries.popitem(last=False)
        return prepared


def _dim3(dims: Sequence[int]) -> tuple[int, int, int]:
    dims = tuple(dims) + (1,) * (3 - len(dims))
    if len(dims) != 3 or any(d < 1 for d in dims):
        raise ValueError(f"launch dimensions must be 1 to 3 positive integers, got {dims}")
    return dims
