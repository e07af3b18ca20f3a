"""Trains a small model with ptxattn's attention and with the framework's own, from the same seed,
initial weights and data, and checks that the two loss curves agree to bf16 noise.

    python scripts/train_smoke.py --framework torch [--steps 20]

The model: token embedding, two pre-norm transformer blocks (causal self-attention, 4 heads of
128, d_model 512, MLP 4x), final norm, unembedding; one fixed batch of 4 x 512 random tokens to
memorize (next-token cross entropy), so that the loss falls quickly; bf16 autocast over FP32
weights; AdamW; forward and backward under torch.compile(fullgraph=True). Three runs, identical
but for the attention:

    ptxattn    ptxattn.torch.attention
    native     the framework's own (torch: SDPA, FlashAttention or cuDNN on an H100)
    naive      the same attention in plain bf16 ops (scores and probabilities rounded to bf16)

The threshold: how far two runs drift apart through bf16 rounding alone is measured, not
guessed. The naive run differs from the native one only by how a straightforward bf16 attention
rounds, the yardstick the tests hold every kernel to (tests/test_attention.py); so at every step
ptxattn's loss may be at most twice as far from the native loss as the naive run ever is (the
tests' factor 2). A fused kernel rounds less than the naive computation, so ptxattn's curve is
expected inside that: on a CPU stand-in of this script (exact attention in place of ptxattn's
kernels, shorter sequences), its largest distance was 0.9-1.3 times the naive run's. bf16's own
relative precision, 2^-8 of the loss, would be no test at all: the runs agree 10-100 times closer.

Prints the curves side by side; exits 1 if ptxattn's curve is further from the native one than
allowed at some step, or if training did not lower the loss; 2 where the framework or a GPU is
missing.

A framework is a function in FRAMEWORKS returning the three curves; another framework (JAX, say)
is one more entry with the same model, data and runs.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import NamedTuple

# torch.compile imports cProfile, which loads the standard library's `profile`, which this
# folder's profile.py would shadow: keep this folder off the import path.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

DEVICE = "cuda"
SEED = 0
VOCAB = 1024
D_MODEL = 512
HEADS = 4
HEAD_DIM = D_MODEL // HEADS
LAYERS = 2
BATCH = 4
SEQLEN = 512
LEARNING_RATE = 3e-4  # the memorized loss falls steadily over 20 steps, without saturating


class LossCurves(NamedTuple):
    """The per-step losses of three runs identical but for their attention."""

    ptxattn: list[float]
    native: list[float]
    naive: list[float]
    native_name: str  # what the framework's own attention is called, for the table


class Unavailable(Exception):
    """The framework or a GPU for it is missing."""


def torch_curves(steps: int) -> LossCurves:
    try:
        import torch
    except ImportError as error:
        raise Unavailable(f"torch does not import: {error}") from None
    if not torch.cuda.is_available():
        raise Unavailable("torch sees no CUDA GPU")
    import torch.nn.functional as F

    import ptxattn.torch

    # All three take and return (batch, seqlen, heads, head_dim).
    def ptxattn_attention(q, k, v):
        return ptxattn.torch.attention(q, k, v, causal=True)

    def sdpa_attention(q, k, v):
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)

    def naive_attention(q, k, v):
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) * HEAD_DIM ** -0.5  # bf16 under autocast
        hidden = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu(1)
        # autocast runs softmax in FP32; the product with v rounds the probabilities to bf16
        probs = scores.masked_fill(hidden, float("-inf")).softmax(dim=-1)
        return (probs @ v).transpose(1, 2)

    class Block(torch.nn.Module):
        def __init__(self, attention):
            super().__init__()
            self.attention = attention
            self.attention_norm = torch.nn.LayerNorm(D_MODEL)
            self.qkv = torch.nn.Linear(D_MODEL, 3 * D_MODEL, bias=False)
            self.out = torch.nn.Linear(D_MODEL, D_MODEL, bias=False)
            self.mlp_norm = torch.nn.LayerNorm(D_MODEL)
            self.mlp = torch.nn.Sequential(torch.nn.Linear(D_MODEL, 4 * D_MODEL), torch.nn.GELU(),
                                           torch.nn.Linear(4 * D_MODEL, D_MODEL))

        def forward(self, x):
            batch, seqlen, _ = x.shape
            qkv = self.qkv(self.attention_norm(x)).view(batch, seqlen, 3, HEADS, HEAD_DIM)
            attended = self.attention(*qkv.unbind(2)).reshape(batch, seqlen, D_MODEL)
            x = x + self.out(attended)
            return x + self.mlp(self.mlp_norm(x))

    class Model(torch.nn.Module):
        def __init__(self, attention):
            super().__init__()
            self.embedding = torch.nn.Embedding(VOCAB, D_MODEL)
            self.blocks = torch.nn.ModuleList(Block(attention) for _ in range(LAYERS))
            self.norm = torch.nn.LayerNorm(D_MODEL)
            self.unembedding = torch.nn.Linear(D_MODEL, VOCAB, bias=False)

        def forward(self, tokens):
            x = self.embedding(tokens)
            for block in self.blocks:
                x = block(x)
            return self.unembedding(self.norm(x))

    generator = torch.Generator(device=DEVICE).manual_seed(SEED)
    tokens = torch.randint(VOCAB, (BATCH, SEQLEN + 1), device=DEVICE, generator=generator)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]

    def train(attention) -> list[float]:
        torch.manual_seed(SEED)  # the same initial weights for every run
        model = Model(attention).to(DEVICE)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE)

        @torch.compile(fullgraph=True)
        def loss_of(inputs, targets):
            with torch.autocast(DEVICE, dtype=torch.bfloat16):
                logits = model(inputs)
            return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

        losses = []
        for _ in range(steps):
            loss = loss_of(inputs, targets)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
        return losses

    return LossCurves(train(ptxattn_attention), train(sdpa_attention), train(naive_attention),
                      "sdpa")


FRAMEWORKS = {"torch": torch_curves}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--framework", choices=sorted(FRAMEWORKS), required=True)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    try:
        curves = FRAMEWORKS[args.framework](args.steps)
    except Unavailable as reason:
        print(f"train_smoke: {reason}", file=sys.stderr)
        return 2

    native = curves.native_name
    naive_distance = max(abs(a - b) for a, b in zip(curves.naive, curves.native))
    allowed = 2 * naive_distance
    print(f"{'step':>4} {'ptxattn':>10} {native:>10} {'naive bf16':>10} "
          f"{'|ptxattn-' + native + '|':>16} {'|naive-' + native + '|':>14}")
    for step, losses in enumerate(zip(curves.ptxattn, curves.native, curves.naive)):
        ours, theirs, naive = losses
        print(f"{step:>4} {ours:>10.5f} {theirs:>10.5f} {naive:>10.5f} "
              f"{abs(ours - theirs):>16.2e} {abs(naive - theirs):>14.2e}")
    distances = [abs(a - b) for a, b in zip(curves.ptxattn, curves.native)]
    exceeded = [step for step, distance in enumerate(distances) if distance > allowed]
    print(f"max |ptxattn - {native}| = {max(distances):.3e}; allowed {allowed:.3e} "
          f"(2 x max |naive bf16 - {native}|)")
    if curves.native[-1] >= curves.native[0]:
        print("FAIL: the loss did not fall, so the curves compare nothing")
        return 1
    if exceeded:
        print(f"FAIL: ptxattn's loss is further from {native}'s than bf16 noise at steps "
              f"{exceeded}")
        return 1
    print("OK: the loss curves agree to bf16 noise")
    return 0


if __name__ == "__main__":
    sys.exit(main())
