"""attention_backward's argument checks (AttentionProblem.from_backward), on array metadata:
no GPU needed."""

import pytest

from meta_array import MetaArray
from ptxattn.problem import AttentionProblem, rows_overlap

SHAPE_Q, SHAPE_KV = (2, 16, 4, 64), (2, 16, 2, 64)


def _arrays(dtype="bfloat16"):
    """dout, q, k, v, out, lse at 1..6 MiB: apart from each other."""
    return dict(dout=MetaArray(SHAPE_Q, dtype, ptr=1 << 20),
                q=MetaArray(SHAPE_Q, dtype, ptr=2 << 20),
                k=MetaArray(SHAPE_KV, dtype, ptr=3 << 20),
                v=MetaArray(SHAPE_KV, dtype, ptr=4 << 20),
                out=MetaArray(SHAPE_Q, dtype, ptr=5 << 20),
                lse=MetaArray((2, 4, 16), "float32", ptr=6 << 20))


def _problem(**overrides):
    args = {**_arrays(), **overrides}
    return AttentionProblem.from_backward(
        args.pop("dout"), args.pop("q"), args.pop("k"), args.pop("v"), args.pop("out"),
        args.pop("lse"), **args)


def test_a_good_call_gives_the_forward_problem():
    p = _problem(causal=True)
    assert (p.format, p.batch, p.seqlen_q, p.heads_q, p.heads_kv, p.head_dim, p.causal) == (
        "bfloat16", 2, 16, 4, 2, 64, True)
    assert p.softmax_scale == pytest.approx(1 / 8)


@pytest.mark.parametrize("name", ["dout", "out"])
def test_dout_and_out_must_match_q(name):
    with pytest.raises(TypeError, match=f"{name} must have q's dtype bfloat16"):
        _problem(**{name: MetaArray(SHAPE_Q, "float16", ptr=7 << 20)})
    with pytest.raises(ValueError, match=f"{name} must have q's shape"):
        _problem(**{name: MetaArray((2, 15, 4, 64), ptr=7 << 20)})
    with pytest.raises(ValueError, match=f"{name} must have unit stride in head_dim"):
        _problem(**{name: MetaArray(SHAPE_Q, strides=(8192, 512, 128, 4), ptr=7 << 20)})


def test_dout_may_have_other_strides_than_out():
    dout = MetaArray(SHAPE_Q, strides=(2 * 4 * 16 * 64, 128, 16 * 128, 2), ptr=7 << 20)
    _problem(dout=dout)


def test_lse_must_be_the_forwards():
    with pytest.raises(TypeError, match="lse must have dtype float32"):
        _problem(lse=MetaArray((2, 4, 16), "bfloat16", ptr=6 << 20))
    with pytest.raises(ValueError, match=r"lse must have shape \(batch, heads_q, seqlen_q\)"):
        _problem(lse=MetaArray((2, 16, 4), "float32", ptr=6 << 20))
    with pytest.raises(ValueError, match="lse must have unit stride along seqlen_q"):
        _problem(lse=MetaArray((2, 4, 16), "float32", strides=(512, 128, 8), ptr=6 << 20))


def test_deterministic_must_be_a_bool():
    with pytest.raises(TypeError, match="deterministic must be a bool"):
        _problem(deterministic=1)


def test_gradient_buffers_are_checked_like_outputs():
    with pytest.raises(ValueError, match=r"dk must have the shape of k \("):
        _problem(dk=MetaArray(SHAPE_Q, ptr=7 << 20))
    with pytest.raises(TypeError, match="dv must have q's dtype"):
        _problem(dv=MetaArray(SHAPE_KV, "float16", ptr=7 << 20))
    with pytest.raises(ValueError, match="dq must not overlap q"):
        _problem(dq=MetaArray(SHAPE_Q, ptr=2 << 20))


def test_packed_gradients_may_interleave_but_not_share():
    """dq, dk, dv as slices of one (batch, seqlen, 3, heads, head_dim) buffer are accepted;
    the same slice twice is refused."""
    shape = (2, 16, 4, 64)
    strides = (16 * 3 * 4 * 128, 3 * 4 * 128, 128, 2)
    base = 8 << 20
    dq, dk, dv = (MetaArray(shape, strides=strides, ptr=base + i * 4 * 128) for i in range(3))
    _problem(k=MetaArray(shape, ptr=3 << 20), v=MetaArray(shape, ptr=4 << 20),
             dq=dq, dk=dk, dv=dv)
    with pytest.raises(ValueError, match="dv must not share memory with dk"):
        _problem(k=MetaArray(shape, ptr=3 << 20), v=MetaArray(shape, ptr=4 << 20),
                 dq=dq, dk=dk, dv=MetaArray(shape, strides=strides, ptr=base + 4 * 128 + 64))


def test_rows_overlap_compares_rows_not_extents():
    a = MetaArray((1, 4, 1, 64), strides=(1024, 256, 256, 2), ptr=0)
    assert not rows_overlap(a, MetaArray((1, 4, 1, 64), strides=(1024, 256, 256, 2), ptr=128))
    assert rows_overlap(a, MetaArray((1, 4, 1, 64), strides=(1024, 256, 256, 2), ptr=126))
    assert rows_overlap(a, MetaArray((1, 1, 1, 64), ptr=3 * 256 + 100))
    assert not rows_overlap(a, MetaArray((1, 1, 1, 64), ptr=4 * 256 - 128))


@pytest.mark.parametrize("block_m", [64, 80, 128])
def test_row_values_are_padded_to_whole_query_tiles(block_m):
    """dpsum and lse_log2 hold whole query tiles of rows per (batch, head): the Hopper kernel
    bulk-copies all of a tile's rows, so the last tile must end inside the head's rows (80-row
    tiles over 1000 rows end at 1040, past a 128-row padding's 1024), and each copy starts on 16
    bytes (a multiple of 4 rows)."""
    from ptxattn.launchers import backward_prepost
    for seqlen in (1, 17, 79, 80, 81, 129, 1000, 2048, 16383):
        rows = backward_prepost.rounded_rows(seqlen, block_m)
        last_tile_end = -(-seqlen // block_m) * block_m
        assert rows >= last_tile_end, (seqlen, rows)
        assert rows >= -(-seqlen // backward_prepost.ROW_PADDING) * backward_prepost.ROW_PADDING, (seqlen, rows)
        assert rows % 4 == 0, (seqlen, rows)
