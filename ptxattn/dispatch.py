"""Which kernel family runs an attention call: one table over (arch, input format, head_dim,
features), read by every entry point.

A :class:`Route` says that inputs of some formats and head dims run through one kernel family's
launcher module on the architectures archs.py lists for that family. :func:`select` takes the
first route of TABLE that fits a call, so the order of TABLE is the order of preference: on
sm_90a 16-bit inputs go to the Hopper kernel unless the portable one is asked for by name.

Needs no GPU: the caller passes the arch (``runtime.device_arch(device_id)``).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib

from . import archs

# What an attention call may need beyond plain attention over whole sequences: "causal"
# masking, "gqa" (fewer k/v heads than q heads), "backward" (the gradients), and the serving
# features: a local "window", a logit "softcap", attention "sinks", and the layouts "varlen"
# (packed sequences of their own lengths), "kvcache" (keys up to each sequence's filled length),
# "paged" (a paged cache), and "decode": a serving call with few query rows a sequence
# (problem.DECODE_QUERIES), which the decode launcher alone serves well. A route lists those its
# family handles and select() passes over the others.
FORWARD = frozenset({"causal", "gqa"})
SERVING = FORWARD | {"window", "softcap", "sinks", "varlen", "kvcache", "paged", "decode"}
PREFILL = FORWARD | {"window", "sinks", "varlen", "kvcache"}
FEATURES = FORWARD | SERVING | {"backward"}
SIXTEEN_BIT = ("bfloat16", "float16")
BLOCK_SCALED = ("mxfp8", "nvfp4")


@dataclasses.dataclass(frozen=True)
class Route:
    backend: str                  # the name a caller picks it by, attention(backend=...)
    family: str                   # the kernel family: archs.py's name, ptxattn.<family> launches
    formats: tuple[str, ...]      # input formats: float16, bfloat16, e4m3, mxfp8, nvfp4
    head_dims: tuple[int, ...]
    emulated: bool = False        # the family's emulation build (archs.Arch.emulated_families)
    features: frozenset[str] = FORWARD
    launcher: str | None = None   # the launcher module, ptxattn.<launcher>, if not the family's

    @property
    def module_name(self) -> str:
        # the package's own name: a second checkout imported under another one (the A/B scripts)
        # must reach its own launchers
        return f"{__package__}.{self.launcher or self.family}"

    @property
    def archs(self) -> tuple[str, ...]:
        return archs.running(self.family, emulated=self.emulated)

    def module(self):
        """The launcher module (imported on first use: the launchers need NVRTC bindings)."""
        return importlib.import_module(self.module_name)

    def describe(self) -> str:
        build = ", emulated" if self.emulated else ""
        return (f"backend {self.backend!r} ({self.module_name}{build}) on "
                f"{', '.join(self.archs)} with head_dim {', '.join(map(str, self.head_dims))}")


TABLE: tuple[Route, ...] = (
    Route("hopper", "hopper", SIXTEEN_BIT, (64, 128, 256)),
    Route("hopper", "hopper", SIXTEEN_BIT, (64, 128, 256), features=PREFILL, launcher="prefill"),
    Route("hopper", "hopper", SIXTEEN_BIT, (64, 128, 256), features=FORWARD | {"backward"},
          launcher="hopper_backward"),
    Route("portable", "portable", SIXTEEN_BIT, (64, 128, 256),
          features=FORWARD | {"backward"}),
    Route("portable", "portable", SIXTEEN_BIT, (64, 128, 256), features=SERVING,
          launcher="decode"),
    Route("hopper", "hopper", ("e4m3",), (64, 128, 256)),
    Route("blockscaled", "blockscaled", BLOCK_SCALED, (64, 128)),
    Route("blockscaled-emulated", "blockscaled", BLOCK_SCALED, (64, 128), emulated=True),
)

FORMATS = tuple(dict.fromkeys(fmt for route in TABLE for fmt in route.formats))

# The backends ptxattn.attention (16-bit inputs) can be asked for by name: their launcher modules.
def _sixteen_bit_backends() -> dict[str, str]:
    """Backend name -> the launcher of its first route (serving calls find theirs through
    select())."""
    backends: dict[str, str] = {}
    for route in TABLE:
        if "bfloat16" in route.formats:
            backends.setdefault(route.backend, route.module_name)
    return backends


BACKENDS = _sixteen_bit_backends()


def backend_module(name: str):
    """The launcher module of a 16-bit backend named in BACKENDS."""
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {sorted(BACKENDS)} or None, got {name!r}")
    return importlib.import_module(BACKENDS[name])


def routes_for(input_format: str, table: tuple[Route, ...] | None = None) -> list[Route]:
    routes = [route for route in (TABLE if table is None else table)
              if input_format in route.formats]
    if not routes:
        raise ValueError(f"input format must be one of {list(FORMATS)}, got {input_format!r}")
    return routes


def head_dims(input_format: str) -> tuple[int, ...]:
    """Every head_dim some GPU runs for inputs of this format (the metadata check before any
    GPU is known)."""
    return tuple(sorted({d for route in routes_for(input_format) for d in route.head_dims}))


def archs_for(input_format: str) -> tuple[str, ...]:
    """The architectures that run inputs of this format at all."""
    return tuple(dict.fromkeys(arch for route in routes_for(input_format)
                               for arch in route.archs))


def select(arch: str, input_format: str, head_dim: int, *, features=frozenset(),
           backend: str | None = None) -> Route:
    """The route for an attention call on an ``arch`` GPU: the first of TABLE that takes
    ``input_format`` and ``head_dim`` there and handles every one of ``features`` (a subset of
    FEATURES), restricted to routes named ``backend`` if given. Raises ValueError naming the
    arch and what the routes for that format support when none fits."""
    return _select(TABLE, arch, input_format, head_dim, frozenset(features), backend)


@functools.lru_cache(maxsize=256)
def _select(table: tuple[Route, ...], arch: str, input_format: str, head_dim: int,
            features: frozenset, backend: str | None) -> Route:
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
    fitting = [route for route in routes if head_dim in route.head_dims]
    if not fitting:
        dims = sorted({d for route in routes for d in route.head_dims})
        raise ValueError(f"head_dim must be one of {dims} for {input_format} inputs on {arch}, "
                         f"got {head_dim} ({supported})")
    for route in fitting:
        if set(features) <= route.features:
            return route
    raise ValueError(f"{input_format} attention with {', '.join(sorted(features))} at head_dim "
                     f"{head_dim} does not run on {arch}: "
                     + "; ".join(f"{route.describe()} handles "
                                 f"{', '.join(sorted(route.features)) or 'none of them'}"
                                 for route in fitting))
