"""scripts/fp8_backward_accuracy.py, the emulation behind docs/design/fp8.md's backward table:
CPU only, on a small case."""

import numpy as np

from inputs import fp8_backward_accuracy_script


def test_the_reference_backward_is_autograd():
    """The script's float64 backward against finite differences of its forward's loss."""
    acc = fp8_backward_accuracy_script()
    rng = np.random.default_rng(0)
    q, k, v, do = (rng.standard_normal((1, 8, 4)) for _ in range(4))
    scale = 0.5
    o, lse = acc.forward(q, k, v, scale, True)
    grads = acc.backward(q, k, v, o, lse, do, scale, True, rounding=lambda x: x)
    for x, g in zip((q, k, v), grads):
        step = np.zeros_like(x)
        step[0, 3, 1] = 1e-6
        x += step
        up = (acc.forward(q, k, v, scale, True)[0] * do).sum()
        x -= 2 * step
        down = (acc.forward(q, k, v, scale, True)[0] * do).sum()
        x += step
        assert abs((up - down) / 2e-6 - g[0, 3, 1]) < 1e-5


def test_e4m3_rounding_and_block_quantization():
    acc = fp8_backward_accuracy_script()
    np.testing.assert_array_equal(acc.e4m3(np.array([1.0, 1.0625, 1.1875, 500.0, -1e9])),
                                  [1.0, 1.0, 1.25, 448.0, -448.0])
    x = np.random.default_rng(1).standard_normal((2, 300, 16))
    x8 = acc.quantize_blocks(x)
    for start in range(0, 300, acc.BLOCK):
        block, block8 = x[:, start:start + acc.BLOCK], x8[:, start:start + acc.BLOCK]
        descale = np.abs(block).max(axis=(1, 2), keepdims=True) / 448
        # half an e4m3 step: 2^-4 of a normal value, 2^-10 of the descale below 2^-6 of it
        assert (np.abs(block8 - block)
                <= np.maximum(np.abs(block) * 2 ** -4, descale * 2 ** -10) + 1e-12).all()


def test_e4m3_recipes_err_more_than_bf16_and_stay_bounded(capsys):
    acc = fp8_backward_accuracy_script()
    assert acc.main(["--seqlen", "256", "--heads", "1", "--head-dim", "64"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines()
            if line.startswith("| normal") or line.startswith("| 0.1%")]
    assert len(rows) == 2
    for row in rows:
        cells = [[float(e) for e in cell.split(" / ")]
                 for cell in row.strip(" |").split(" | ")[1:]]
        bf16, fp8_forward, *e4m3 = cells
        assert max(bf16) < 0.01
        assert min(fp8_forward) > 2 * max(bf16)
        assert all(max(cell) < 0.25 for cell in (fp8_forward, *e4m3))
