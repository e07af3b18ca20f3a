"""Which kernel family runs an attention call: one table over (arch, input format, head_dim,
features), read by every entry point.

A :class:`Route` says that inputs of some formats and head dims run through one launcher
(ptxattn/launchers/) on the architectures archs.py lists for its family, and which of the
launcher's calls (:class:`ptxattn.launchers.Launcher`) it makes. :func:`select` takes the first
route of TABLE that fits a call, so the order of TABLE is the order of preference: on sm_90a
16-bit inputs go to the Hopper kernel unless the portable one is asked for by name.

Fixed-length calls with a window, a softcap or sinks run on a serving build (the fixed-length
kernels take none of them): select() gives them a serving route, and :func:`forward` calls its
launcher's serve() over the whole of k and v.

Head dims: a route lists the head dims its kernels are compiled for. A 16-bit or FP8 call may
have any head_dim that is a multiple of 16 bytes (8 16-bit values, 16 e4m3 ones) up to the largest
of them, and runs on the least that holds it (launchers.kernel_head_dim): the kernels' loads fill
the columns past the call's with zeros and their stores leave them alone, so no array is padded
in memory. The 16-bit routes also take value heads narrower than the query/key heads
(head_dim_v <= head_dim, e.g. 192/128), V's and the output's columns bounded the same way. The
block-scaled formats run their compiled head dims only (their scales cover 32 columns).

Needs no GPU: the caller passes the arch (``runtime.device_arch(device_id)``).
"""

from __future__ import annotations

import dataclasses
import functools

from . import archs
from .launchers import (Launcher, blockscaled, hopper_backward, hopper_forward,
                        portable_backward, portable_decode, portable_forward, portable_mla)

# What an attention call may need beyond plain attention over whole sequences: "causal"
# masking, "gqa" (fewer k/v heads than q heads), "backward" (the gradients), and the serving
# features: a local "window", a logit "softcap", attention "sinks", and the layouts "varlen"
# (packed sequences of their own lengths), "kvcache" (keys up to each sequence's filled length),
# "paged" (a paged cache), "decode": a serving call with few query rows a sequence
# (problem.DECODE_QUERIES), which the decode launcher alone serves well, and "fp8_kv", an e4m3
# cache. A route lists those its family handles and select() passes over the others. "mla"
# (multi-head latent attention over one latent cache, ptxattn.attention_mla_decode) is a call
# of its own: its routes take those calls only, and no others take them.
FORWARD = frozenset({"causal", "gqa"})
SERVING = FORWARD | {"window", "softcap", "sinks", "varlen", "kvcache", "paged", "decode",
                     "fp8_kv"}
MLA = FORWARD | {"kvcache", "paged", "decode", "fp8_kv", "mla"}
PREFILL = FORWARD | {"window", "softcap", "sinks", "varlen", "kvcache"}
FEATURES = FORWARD | SERVING | MLA | {"backward"}
# The gradients: of fixed-length and packed calls, with the forward's window, softcap and sinks.
BACKWARD = FORWARD | {"backward", "window", "softcap", "sinks", "varlen"}
# What only the serving builds take of a fixed-length call.
SERVING_OPTIONS = frozenset({"window", "softcap", "sinks"})
SIXTEEN_BIT = ("bfloat16", "float16")
BLOCK_SCALED = ("mxfp8", "nvfp4")
CALLS = ("forward", "backward", "serve")
# Bytes an element of each format takes: a head_dim runs padded where its rows are whole
# 16-byte pieces (TMA boxes and cp.async chunks), and the strides of every array are too.
ITEM_BYTES = {"bfloat16": 2, "float16": 2, "e4m3": 1}
ROW_PIECE_BYTES = 16


@dataclasses.dataclass(frozen=True)
class Route:
    backend: str                  # the name a caller picks it by, attention(backend=...)
    family: str                   # the kernel family: archs.py's name
    formats: tuple[str, ...]      # input formats: float16, bfloat16, e4m3, mxfp8, nvfp4
    head_dims: tuple[int, ...]
    launcher: Launcher            # the launcher module (ptxattn/launchers/)
    call: str = "forward"         # which of the launcher's CALLS the route makes
    emulated: bool = False        # the family's emulation build (archs.Arch.emulated_families)
    features: frozenset[str] = FORWARD
    padded: bool = True           # runs every head_dim below its largest (the module docstring)
    narrow_v: bool = False        # takes head_dim_v < head_dim
    smem_per_block: int = 0       # the shared memory its kernels need a block, where that
                                  # rules out some of the family's archs

    @property
    def archs(self) -> tuple[str, ...]:
        return tuple(a for a in archs.running(self.family, emulated=self.emulated)
                     if archs.get(a).smem_per_block >= self.smem_per_block)

    def takes(self, input_format: str, head_dim: int, head_dim_v: int) -> bool:
        """Whether the route runs a call of these head dims."""
        if head_dim_v != head_dim and not (self.narrow_v and head_dim_v < head_dim and
                                           takes_head_dim(input_format, head_dim_v)):
            return False
        if not self.padded:
            return head_dim in self.head_dims
        return takes_head_dim(input_format, head_dim) and head_dim <= max(self.head_dims)

    def describe(self) -> str:
        build = ", emulated" if self.emulated else ""
        dims = ", ".join(map(str, self.head_dims))
        dims = (f"head_dim {head_dim_rule(self.formats[0], max(self.head_dims))} (compiled "
                f"{dims})" if self.padded else f"head_dim {dims}")
        return (f"backend {self.backend!r} ({self.launcher.__name__}.{self.call}{build}) on "
                f"{', '.join(self.archs)} with {dims}"
                + (", head_dim_v <= head_dim" if self.narrow_v else ""))


def head_dim_step(input_format: str) -> int:
    """The columns of ``input_format`` in one 16-byte piece (formats of their own layouts, the
    block-scaled ones: 1)."""
    return ROW_PIECE_BYTES // ITEM_BYTES.get(input_format, ROW_PIECE_BYTES)


def takes_head_dim(input_format: str, head_dim: int) -> bool:
    """Whether ``head_dim`` columns of ``input_format`` are whole 16-byte pieces."""
    step = head_dim_step(input_format)
    return head_dim >= step and head_dim % step == 0


def head_dim_rule(input_format: str, largest: int) -> str:
    """The padded routes' head_dim rule in words."""
    step = head_dim_step(input_format)
    return f"a multiple of {step} from {step} to {largest}"


TABLE: tuple[Route, ...] = (
    Route("hopper", "hopper", SIXTEEN_BIT, hopper_forward.HEAD_DIMS, hopper_forward,
          narrow_v=True),
    Route("hopper", "hopper", SIXTEEN_BIT, hopper_forward.HEAD_DIMS, hopper_forward,
          call="serve", features=PREFILL, narrow_v=True),
    Route("hopper", "hopper", SIXTEEN_BIT, hopper_backward.HEAD_DIMS, hopper_backward,
          call="backward", features=BACKWARD, narrow_v=True),
    Route("portable", "portable", SIXTEEN_BIT, portable_forward.HEAD_DIMS, portable_forward,
          narrow_v=True),
    Route("portable", "portable", SIXTEEN_BIT, portable_backward.HEAD_DIMS, portable_backward,
          call="backward", features=BACKWARD, narrow_v=True),
    Route("portable", "portable", SIXTEEN_BIT, portable_decode.HEAD_DIMS, portable_decode,
          call="serve", features=SERVING, narrow_v=True),
    Route("portable", "portable", SIXTEEN_BIT, portable_mla.HEAD_DIMS, portable_mla,
          call="serve", features=MLA, padded=False, narrow_v=True,
          smem_per_block=portable_mla.SMEM_PER_BLOCK),
    Route("hopper", "hopper", ("e4m3",), hopper_forward.FP8_HEAD_DIMS, hopper_forward),
    Route("hopper", "hopper", ("e4m3",), hopper_backward.FP8_HEAD_DIMS, hopper_backward,
          call="backward", features=FORWARD | {"backward"}, padded=False),
    Route("blockscaled", "blockscaled", BLOCK_SCALED, blockscaled.HEAD_DIMS, blockscaled,
          padded=False),
    Route("blockscaled-emulated", "blockscaled", BLOCK_SCALED, blockscaled.HEAD_DIMS,
          blockscaled, emulated=True, padded=False),
)

FORMATS = tuple(dict.fromkeys(fmt for route in TABLE for fmt in route.formats))
# The backends ptxattn.attention (16-bit inputs) can be asked for by name.
BACKENDS = tuple(dict.fromkeys(route.backend for route in TABLE if "bfloat16" in route.formats))
# Every launcher of the table, each once: `python -m ptxattn kernels` compiles their variants.
LAUNCHERS = tuple(dict.fromkeys(route.launcher for route in TABLE))


def routes_for(input_format: str, table: tuple[Route, ...] | None = None) -> list[Route]:
    routes = [route for route in (TABLE if table is None else table)
              if input_format in route.formats]
    if not routes:
        raise ValueError(f"input format must be one of {list(FORMATS)}, got {input_format!r}")
    return routes


def attention_routes(input_format: str) -> list[Route]:
    """routes_for() less the MLA routes, whose head dims are those of MLA's latent cache alone
    (AttentionProblem.from_mla_decode checks them): the routes the head-dim rules speak of."""
    return [route for route in routes_for(input_format) if "mla" not in route.features]


def head_dims(input_format: str) -> tuple[int, ...]:
    """Every compiled head_dim of some attention route for inputs of this format."""
    return tuple(sorted({d for route in attention_routes(input_format)
                         for d in route.head_dims}))


def check_head_dims(input_format: str, head_dim: int, head_dim_v: int | None = None) -> None:
    """Refuses head dims that no route runs for this format (the metadata check before any
    GPU is known), naming the rule."""
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    routes = attention_routes(input_format)
    if not any(route.takes(input_format, head_dim, head_dim) for route in routes):
        raise ValueError(f"head_dim must be {_dims_rule(input_format, routes)} for "
                         f"{input_format} inputs, got {head_dim}")
    if not any(route.takes(input_format, head_dim, head_dim_v) for route in routes):
        if any(route.narrow_v for route in routes):
            rule = (f"at most head_dim ({head_dim}) and "
                    f"{head_dim_rule(input_format, head_dim)}")
        else:
            rule = f"head_dim ({head_dim}) for {input_format} inputs"
        raise ValueError(f"v's head_dim (head_dim_v) must be {rule}, got {head_dim_v}")


def _dims_rule(input_format: str, routes: list[Route]) -> str:
    if any(route.padded for route in routes):
        return head_dim_rule(input_format, max(d for route in routes for d in route.head_dims))
    return f"one of {list(head_dims(input_format))}"


def archs_for(input_format: str) -> tuple[str, ...]:
    """The architectures that run inputs of this format at all."""
    return tuple(dict.fromkeys(arch for route in routes_for(input_format)
                               for arch in route.archs))


def select(arch: str, input_format: str, head_dim: int, *, features=frozenset(),
           backend: str | None = None, head_dim_v: int | None = None) -> Route:
    """The route for an attention call on an ``arch`` GPU: the first of TABLE that takes
    ``input_format``, ``head_dim`` and ``head_dim_v`` (v's, if not head_dim) there and handles
    every one of ``features`` (a subset of FEATURES), restricted to routes named ``backend`` if
    given. Raises ValueError naming the arch and what the routes for that format support when
    none fits."""
    return _select(TABLE, arch, input_format, head_dim,
                   head_dim if head_dim_v is None else head_dim_v, frozenset(features), backend)


@functools.lru_cache(maxsize=256)
def _select(table: tuple[Route, ...], arch: str, input_format: str, head_dim: int,
            head_dim_v: int, features: frozenset, backend: str | None) -> Route:
    """select() over ``table`` (TABLE, passed so that it is part of the key), remembered:
    every call of an entry point asks it. Refusals are not kept."""
    archs.get(arch)
    routes = routes_for(input_format, table)
    if backend is not None:
        names = sorted({route.backend for route in routes})
        routes = [route for route in routes if route.backend == backend]
        if not routes:
            raise ValueError(f"backend must be one of {names} or None for {input_format} "
                             f"inputs, got {backend!r}")
    supported = "; ".join(route.describe() for route in routes)
    routes = [route for route in routes if arch in route.archs]
    if not routes:
        raise ValueError(f"{input_format} attention does not run on this {arch} GPU; it runs "
                         f"as {supported}")
    fitting = [route for route in routes if route.takes(input_format, head_dim, head_dim_v)]
    if not fitting:
        dims = (f"head_dim {head_dim}" if head_dim_v == head_dim
                else f"head_dim {head_dim} with head_dim_v {head_dim_v}")
        raise ValueError(f"{input_format} attention at {dims} does not run on {arch}; it runs "
                         f"as {supported}")
    # a backward route takes the calls for gradients, and only those; an MLA route MLA calls
    def same_call(route):
        return (("backward" in features) == (route.call == "backward")
                and ("mla" in features) == ("mla" in route.features))

    fitting = [route for route in fitting if same_call(route)]
    if not fitting:
        call = ("backward" if "backward" in features else
                "MLA attention" if "mla" in features else "attention")
        of_the_call = [route.describe() for route in routes if same_call(route)]
        if not of_the_call:
            raise ValueError(f"{input_format} inputs have no {call} route; they run as "
                             f"{supported}")
        raise ValueError(f"the {input_format} {call} at head_dim {head_dim} does not run on "
                         f"{arch}; it runs as " + "; ".join(of_the_call))
    for route in fitting:
        if set(features) <= route.features:
            return route
    raise ValueError(f"{input_format} attention with {', '.join(sorted(features))} at head_dim "
                     f"{head_dim} does not run on {arch}: "
                     + "; ".join(f"{route.describe()} handles "
                                 f"{', '.join(sorted(route.features)) or 'none of them'}"
                                 for route in fitting))


def forward(route: Route, problem, q, k, v, out, lse, *, sinks=None, **operands) -> None:
    """Runs the forward of a fixed-length ``problem`` (AttentionProblem.from_16bit, from_fp8 or
    from_blockscaled) into ``out`` and ``lse`` on ``route``, what select() picked for it.
    ``operands`` are what the input format adds (FP8's descales, the block scales). A call with
    a window, a softcap or sinks has a serving route, whose keys are then all of k and v (no
    seqused_k: the serving kernels take seqlen_k for every sequence): the fixed-length kernels
    take none of the three."""
    if route.call == "serve":
        route.launcher.serve(problem, q, k, v, out, lse, sinks=sinks)
    else:
        route.launcher.forward(problem, q, k, v, out, lse, **operands)
