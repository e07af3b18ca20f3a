"""How FP8 attention quantizes its 16-bit inputs, as one value: ``Fp8Recipe``, which
``ptxattn.torch.fp8_attention`` takes. ptxattn.fp8 re-exports it."""

from __future__ import annotations

import dataclasses

from .fp8 import GRANULARITIES

__all__ = ["Fp8Recipe"]

# numpy.random.default_rng takes any non-negative int; a torch op's schema carries an int64.
_SEED_LIMIT = 2 ** 63


@dataclasses.dataclass(frozen=True)
class Fp8Recipe:
    """How q, k and v are quantized to e4m3 for FP8 attention: ``fp8.quantize_qkv``'s options.

    Frozen (hashable, comparable): one recipe can be kept by a model and passed to every call.
    The attention call is the same whatever the recipe: it changes only what the quantizers
    compute (docs/guide/fp8.md).

    Parameters
    ----------
    granularity : {'tensor', 'head', 'block'}, default 'block'
        The descale granularity of q and k: one descale per tensor, per (batch, head), or per 128
        rows of one head (amax / 448 over each). v takes the same, except "head" (one descale
        per (batch, kv-head)) where q and k take "block": V's rows are the keys that P V sums
        over, so a per-block V scale would rescale the accumulator at every key block.
    rotate : bool, default False
        Quantize q R and k R rather than q and k, R one random-sign Hadamard rotation along
        head_dim (``fp8.hadamard_rotation(head_dim, seed)``), shared by q and k so that q k^T is
        unchanged; outlier channels are spread over the whole row, which e4m3 then rounds more
        evenly. v is never rotated; gradients are rotated back (dq = dq' R^T, dk likewise).
        Needs head_dim 64, 128 or 256.
    seed : int, default 0
        The seed R's signs are drawn from, non-negative and below 2**63: the forward and the
        backward draw the same R from it. Unused without ``rotate``.

    Raises
    ------
    ValueError
        ``granularity`` none of ``fp8.GRANULARITIES``; ``seed`` negative or 2**63 or more.
    TypeError
        ``granularity`` not a str, ``rotate`` not a bool, ``seed`` not an int (a bool is none).

    Examples
    --------
    >>> from ptxattn.fp8 import Fp8Recipe
    >>> recipe = Fp8Recipe("block", rotate=True, seed=1)
    >>> recipe.v_granularity
    'head'
    >>> out = ptxattn.torch.fp8_attention(q, k, v, causal=True, recipe=recipe)
    """

    granularity: str = "block"
    rotate: bool = False
    seed: int = 0

    def __post_init__(self):
        if not isinstance(self.granularity, str):
            raise TypeError(f"Fp8Recipe.granularity must be a str, one of {GRANULARITIES}, got "
                            f"{type(self.granularity).__name__}")
        if self.granularity not in GRANULARITIES:
            raise ValueError(f"Fp8Recipe.granularity must be one of {GRANULARITIES}, got "
                             f"{self.granularity!r}")
        if not isinstance(self.rotate, bool):
            raise TypeError(f"Fp8Recipe.rotate must be a bool, got "
                            f"{type(self.rotate).__name__}")
        # bool is an int subclass, but True as a seed is a mistake, not a seed
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise TypeError(f"Fp8Recipe.seed must be an int, got {type(self.seed).__name__}")
        if not 0 <= self.seed < _SEED_LIMIT:
            raise ValueError(f"Fp8Recipe.seed must be non-negative and below 2**63, got "
                             f"{self.seed}")

    @property
    def v_granularity(self) -> str:
        """The descale granularity of v: "head" where q and k take "block", theirs otherwise."""
        return "head" if self.granularity == "block" else self.granularity
