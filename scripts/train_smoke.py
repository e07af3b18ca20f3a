"""Trains a small model with ptxattn's attention and with a reference attention, from the same
seed, initial weights and data, and checks that the two loss curves agree to bf16 noise.

    python scripts/train_smoke.py --framework torch [--steps 20] [--packed | --gpt-oss]
                                  [--plot FILE.png] [--json FILE]
    python scripts/train_smoke.py --framework torch --fp8-attention [--fp8-rotate] [--steps 200]
                                  [--plot FILE.png] [--json FILE]

The model: token embedding, two pre-norm transformer blocks (causal self-attention, 4 heads of
128, d_model 512, MLP 4x), final norm, unembedding; one fixed batch of 4 x 512 random tokens to
memorize (next-token cross entropy), so that the loss falls quickly; bf16 autocast over FP32
weights; AdamW; forward and backward under torch.compile(fullgraph=True). Three runs, identical
but for the attention:

    ptxattn    ptxattn.torch.attention
    reference  the framework's own (torch: SDPA, FlashAttention or cuDNN on an H100)
    naive      the same attention in plain bf16 ops (scores and probabilities rounded to bf16)

Two other attentions in the same model, each a flag:

    --packed   each row of the batch holds 2 to 6 documents of random lengths (from the seed),
               and a token attends causally within its own document only: ptxattn runs
               ptxattn.torch.attention_varlen over the rows as one packed batch, cu_seqlens at
               the document boundaries
    --gpt-oss  gpt-oss's attention: 8 heads of 64, a sliding window of 128 keys (window
               (127, 0)) on every other layer, and a learned float32 sink logit per head and
               layer, trained with the rest

SDPA takes no sinks, and a document or window mask only as a dense mask tensor, so for these two
the reference is the attention in FP32 eager ops, as the tests' reference is: a block-diagonal
causal mask, or a window mask and the sinks as one more column of the softmax; the naive run is
the same ops under bf16 autocast.

The threshold: how far two runs drift apart through bf16 rounding alone is measured, not
guessed. The naive run differs from the reference only by how a straightforward bf16 attention
rounds, the yardstick the tests hold every kernel to (tests/test_attention.py); so at every step
ptxattn's loss may be at most twice as far from the reference loss as the naive run ever is (the
tests' factor 2). A fused kernel rounds less than the naive computation, so ptxattn's curve is
expected inside that: on a CPU stand-in of this script (exact attention in place of ptxattn's
kernels, shorter sequences), its largest distance was 0.9-1.3 times the naive run's (1.0 with
--packed, 1.1 with --gpt-oss, at full length). bf16's own relative precision, 2^-8 of the loss,
would be no test at all: the runs agree 10-100 times closer. With sinks the trained sinks are
held to the same rule: AdamW moves them by about the learning rate a step whatever their
gradient's size, too little to show in the loss, so a gradient of the wrong sign, or none,
would pass the loss check alone (on the stand-in, sinks without a gradient did).

FP8. --fp8-attention trains the default model twice, identical but for the attention:
ptxattn.torch.fp8_attention (q and k quantized to e4m3 per 128-row block, v per head: the
default Fp8Recipe; --fp8-rotate adds the Hadamard rotation of q and k) and
ptxattn.torch.attention in bf16; 200 steps unless --steps says otherwise, at FP8_LEARNING_RATE.
FP8's gradients are several percent off the bf16 ones (docs/design/fp8.md), far beyond bf16
noise, so what is held is the outcome: the final losses agree within 2% of the bf16 run's. The
learning rate is a sixth of the others' so that 200 steps take the loss to about 0.75 rather
than to memorization: the FP8 run learns a little slower (it trails by a fraction of a step),
and once the loss falls by a roughly fixed fraction a step, as it does on its way to 0, that lag
alone is a relative distance, which grows with it. On a CPU stand-in (FP32, full size; FP8
emulated in the forward only: q, k, v quantized as the default recipe says, P rounded to e4m3,
the gradients passed straight through) the final distance was 0.33% at this rate (0.32%
rotated), 0.96% at 7.5e-5 (loss 0.24) and 2.4% at the others' 3e-4 (loss 0.005, memorized); with
dq and dk rotated back by R rather than R^T it was 32%, with no gradient for q and k 35%.

Prints the curves side by side and the largest distance, also relative to the reference's loss
(--fp8-attention: the two curves and their relative distance); --plot draws the curves and
their relative distances from the reference (matplotlib), --json writes them. Exits 1 if
ptxattn's curve (or its trained sinks) is further from the reference than allowed, or if
training did not lower the loss; 2 where the framework, a GPU (for --fp8-attention one that
ptxattn's FP8 kernels run on) or, for --plot, matplotlib is missing.

A framework is a function in FRAMEWORKS returning the three curves of a ModelSpec, and in
FP8_FRAMEWORKS the two of an Fp8Recipe; another framework (JAX, say) is one more entry with the
same models, data and runs.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import os
import random
import sys
from typing import NamedTuple

# torch.compile imports cProfile, which loads the standard library's `profile`, which this
# folder's profile.py would shadow: keep this folder off the import path, and the checkout's
# package on it.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
sys.path.insert(0, os.path.dirname(_HERE))

DEVICE = "cuda"
SEED = 0
VOCAB = 1024
D_MODEL = 512
LAYERS = 2
BATCH = 4
SEQLEN = 512
LEARNING_RATE = 3e-4  # the memorized loss falls steadily over 20 steps, without saturating
STEPS = 20
# --fp8-attention (module docstring)
FP8_STEPS = 200
FP8_LEARNING_RATE = 5e-5
FP8_TOLERANCE = 0.02  # of the bf16 run's final loss
FULL = (-1, -1)  # no window


class ModelSpec(NamedTuple):
    """What a model's attention is."""

    head_dim: int
    packed: bool  # documents of random lengths back to back in each row, attending apart
    windows: tuple  # per layer, (left, right) keys around the diagonal; FULL: none
    sinks: bool  # a learned float32 sink logit per head and layer
    reference: str  # "sdpa": the framework's fused attention; "fp32": FP32 eager ops


MODELS = {
    "default": ModelSpec(128, packed=False, windows=(FULL,) * LAYERS, sinks=False,
                         reference="sdpa"),
    "packed": ModelSpec(128, packed=True, windows=(FULL,) * LAYERS, sinks=False,
                        reference="fp32"),
    "gpt-oss": ModelSpec(64, packed=False, sinks=True, reference="fp32",
                         windows=tuple((127, 0) if layer % 2 == 0 else FULL
                                       for layer in range(LAYERS))),
}


class LossCurves(NamedTuple):
    """The per-step losses of three runs identical but for their attention, and with sinks
    each run's trained sinks (every layer's, one list)."""

    ptxattn: list[float]
    reference: list[float]
    naive: list[float]
    reference_name: str  # what the reference attention is called, for the table
    sinks: tuple[list[float], list[float], list[float]] | None  # ptxattn, reference, naive


class Fp8Curves(NamedTuple):
    """The per-step losses of two runs identical but for their attention: ptxattn's FP8 and
    ptxattn's bf16."""

    fp8: list[float]
    bf16: list[float]


class Unavailable(Exception):
    """The framework or a GPU for it is missing."""


def document_lengths(rng: random.Random) -> list[list[int]]:
    """Per row of the batch, the lengths of its 2 to 6 documents, which fill its SEQLEN tokens."""
    rows = []
    for _ in range(BATCH):
        cuts = sorted(rng.sample(range(1, SEQLEN), rng.randint(1, 5)))
        rows.append([end - start for start, end in zip([0, *cuts], [*cuts, SEQLEN])])
    return rows


def torch_training(spec: ModelSpec, learning_rate: float):
    """What every torch run of ``spec`` shares: ``train(attention, steps)``, which trains the
    model from the seed's weights on the seed's batch with ``attention`` and returns its
    per-step losses and (with sinks) its trained sinks, and the attentions by name ("ptxattn",
    "sdpa", "fp32", "naive"), each taking and returning (batch, seqlen, heads, head_dim) and
    its layer's window and sinks."""
    try:
        import torch
    except ImportError as error:
        raise Unavailable(f"torch does not import: {error}") from None
    if not torch.cuda.is_available():
        raise Unavailable("torch sees no CUDA GPU")
    import torch.nn.functional as F

    import ptxattn.torch

    heads = D_MODEL // spec.head_dim
    # the packed model's documents, each row's back to back
    lengths = [n for row in document_lengths(random.Random(SEED)) for n in row]
    longest = max(lengths)
    cu_seqlens = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32,
                              device=DEVICE)
    document = torch.arange(len(lengths), device=DEVICE).repeat_interleave(
        torch.tensor(lengths, device=DEVICE)).view(BATCH, SEQLEN)

    def visible(window):
        """The (query, key) pairs a layer attends, broadcast over batch and heads."""
        query = torch.arange(SEQLEN, device=DEVICE)[:, None]
        key = torch.arange(SEQLEN, device=DEVICE)[None, :]
        seen = key <= query
        if window[0] >= 0:
            seen = seen & (key >= query - window[0])
        if spec.packed:
            seen = seen & (document[:, :, None] == document[:, None, :])
        return seen.unsqueeze(-3)

    masks = {window: visible(window) for window in set(spec.windows)}

    # All take and return (batch, seqlen, heads, head_dim), sinks float32 (heads,) or None.
    def ptxattn_attention(q, k, v, window, sinks):
        if not spec.packed:
            return ptxattn.torch.attention(q, k, v, causal=True, window=window, sinks=sinks)
        # the rows back to back are one sequence per document
        packed = (x.flatten(0, 1) for x in (q, k, v))
        return ptxattn.torch.attention_varlen(
            *packed, cu_seqlens, cu_seqlens, longest, longest, causal=True,
            window=window, sinks=sinks).view(q.shape)

    def sdpa_attention(q, k, v, window, sinks):  # the default model's: no window, no sinks
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)

    def naive_attention(q, k, v, window, sinks):
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) * spec.head_dim ** -0.5  # bf16 under autocast
        scores = scores.masked_fill(~masks[window], float("-inf"))
        # autocast runs softmax in FP32; the product with v rounds the probabilities to bf16
        if sinks is None:
            probs = scores.softmax(dim=-1)
        else:  # a sink is one more logit in every row's softmax, attending to nothing
            sink_logits = sinks[:, None, None].expand(*scores.shape[:-1], 1)
            probs = torch.cat([scores, sink_logits], dim=-1).softmax(dim=-1)[..., :-1]
        return (probs @ v).transpose(1, 2)

    def fp32_attention(q, k, v, window, sinks):
        with torch.autocast(DEVICE, enabled=False):  # the naive ops, nothing rounded to bf16
            return naive_attention(q.float(), k.float(), v.float(), window, sinks)

    class Block(torch.nn.Module):
        def __init__(self, attention, window):
            super().__init__()
            self.attention = attention
            self.window = window
            self.attention_norm = torch.nn.LayerNorm(D_MODEL)
            self.qkv = torch.nn.Linear(D_MODEL, 3 * D_MODEL, bias=False)
            self.out = torch.nn.Linear(D_MODEL, D_MODEL, bias=False)
            self.mlp_norm = torch.nn.LayerNorm(D_MODEL)
            self.mlp = torch.nn.Sequential(torch.nn.Linear(D_MODEL, 4 * D_MODEL), torch.nn.GELU(),
                                           torch.nn.Linear(4 * D_MODEL, D_MODEL))
            # created last and from zeros: every model draws the same initial weights above
            self.sinks = torch.nn.Parameter(torch.zeros(heads)) if spec.sinks else None

        def forward(self, x):
            batch, seqlen, _ = x.shape
            qkv = self.qkv(self.attention_norm(x)).view(batch, seqlen, 3, heads, spec.head_dim)
            attended = self.attention(*qkv.unbind(2), self.window, self.sinks)
            x = x + self.out(attended.reshape(batch, seqlen, D_MODEL))
            return x + self.mlp(self.mlp_norm(x))

    class Model(torch.nn.Module):
        def __init__(self, attention):
            super().__init__()
            self.embedding = torch.nn.Embedding(VOCAB, D_MODEL)
            self.blocks = torch.nn.ModuleList(Block(attention, window)
                                              for window in spec.windows)
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

    def train(attention, steps: int) -> tuple[list[float], list[float] | None]:
        torch.manual_seed(SEED)  # the same initial weights for every run
        model = Model(attention).to(DEVICE)
        optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate)

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
        sinks = [s for block in model.blocks for s in block.sinks.tolist()] if spec.sinks else None
        return losses, sinks

    return train, {"ptxattn": ptxattn_attention, "sdpa": sdpa_attention, "fp32": fp32_attention,
                   "naive": naive_attention}


def torch_curves(steps: int, spec: ModelSpec) -> LossCurves:
    train, attentions = torch_training(spec, LEARNING_RATE)
    (ours, our_sinks), (theirs, their_sinks), (naive, naive_sinks) = (
        train(attentions[name], steps) for name in ("ptxattn", spec.reference, "naive"))
    return LossCurves(ours, theirs, naive, spec.reference,
                      (our_sinks, their_sinks, naive_sinks) if spec.sinks else None)


def torch_fp8_curves(steps: int, recipe) -> Fp8Curves:
    """The default model trained with ptxattn.torch.fp8_attention (``recipe``) and with
    ptxattn.torch.attention, at FP8_LEARNING_RATE."""
    train, attentions = torch_training(MODELS["default"], FP8_LEARNING_RATE)
    import torch  # which torch_training found, with a GPU

    import ptxattn.torch
    from ptxattn import archs, fp8

    try:
        arch = archs.arch_for_capability(*torch.cuda.get_device_capability())
    except archs.UnsupportedGpuError as error:
        raise Unavailable(str(error)) from None
    if arch not in fp8.ARCHS:
        raise Unavailable(f"ptxattn's FP8 attention runs on {', '.join(fp8.ARCHS)}, this GPU "
                          f"is {arch}")

    def fp8_attention(q, k, v, window, sinks):  # the default model's: no window, no sinks
        return ptxattn.torch.fp8_attention(q, k, v, causal=True, recipe=recipe)

    (fp8_losses, _), (bf16_losses, _) = (train(attention, steps) for attention in
                                         (fp8_attention, attentions["ptxattn"]))
    return Fp8Curves(fp8_losses, bf16_losses)


FRAMEWORKS = {"torch": torch_curves}
FP8_FRAMEWORKS = {"torch": torch_fp8_curves}


def drift(ours: list[float], reference: list[float], naive: list[float]):
    """|ours - reference| elementwise, and what it may reach: 2 x max |naive - reference|."""
    distances = [abs(a - b) for a, b in zip(ours, reference)]
    return distances, 2 * max(abs(a - b) for a, b in zip(naive, reference))


def write_curves(losses: dict[str, list[float]], reference: str, title: str,
                 plot: str | None, json_path: str | None,
                 tolerance: float | None = None) -> None:
    """The loss curves (name -> per-step losses) as JSON and as a PNG where asked: the curves on
    a log scale, under them each one's relative distance from ``reference``'s and the
    ``tolerance`` it is held to, if relative. matplotlib is imported here only."""
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"title": title, "reference": reference, "losses": losses}, f, indent=1)
    if not plot:
        return
    import matplotlib
    matplotlib.use("Agg")  # a file, no display
    import matplotlib.pyplot as plt

    figure, (curves, distances) = plt.subplots(2, 1, figsize=(8, 7), sharex=True,
                                               gridspec_kw={"height_ratios": (2, 1)})
    for name, curve in losses.items():
        line, = curves.plot(curve, label=name)
        if name != reference:
            distances.plot([abs(a - b) / b for a, b in zip(curve, losses[reference])],
                           color=line.get_color(), label=f"|{name} - {reference}| / {reference}")
    if tolerance is not None:
        distances.axhline(tolerance, color="black", linestyle="--", label="allowed at the end")
    curves.set(ylabel="loss", yscale="log", title=title)
    distances.set(xlabel="step", ylabel="relative distance", yscale="log")
    curves.legend()
    distances.legend()
    figure.savefig(plot, dpi=120, bbox_inches="tight")
    plt.close(figure)
    print(f"wrote {plot}")


def verdict(failures: list[str], success: str) -> int:
    for failure in failures:
        print(f"FAIL: {failure}")
    if failures:
        return 1
    print(f"OK: {success}")
    return 0


def compare_fp8(framework: str, steps: int, recipe, plot: str | None,
                json_path: str | None) -> int:
    """--fp8-attention: prints both curves and their relative distance, writes the files asked
    for, and returns main's exit status."""
    try:
        curves = FP8_FRAMEWORKS[framework](steps, recipe)
    except Unavailable as reason:
        print(f"train_smoke: {reason}", file=sys.stderr)
        return 2
    print(f"{'step':>4} {'fp8':>10} {'bf16':>10} {'|fp8-bf16|/bf16':>16}")
    for step, (fp8_loss, bf16_loss) in enumerate(zip(curves.fp8, curves.bf16)):
        print(f"{step:>4} {fp8_loss:>10.5f} {bf16_loss:>10.5f} "
              f"{abs(fp8_loss - bf16_loss) / bf16_loss:>16.2e}")
    final = abs(curves.fp8[-1] - curves.bf16[-1]) / curves.bf16[-1]
    print(f"final losses: fp8 {curves.fp8[-1]:.5f}, bf16 {curves.bf16[-1]:.5f}; relative "
          f"distance {final:.3e}, allowed {FP8_TOLERANCE:.0%}")
    write_curves({"fp8": curves.fp8, "bf16": curves.bf16}, "bf16",
                 f"ptxattn.torch.fp8_attention against ptxattn.torch.attention\n{recipe}, "
                 f"learning rate {FP8_LEARNING_RATE}", plot, json_path, FP8_TOLERANCE)
    failures = []
    if not curves.bf16[-1] < curves.bf16[0]:
        failures.append("the loss did not fall, so the curves compare nothing")
    if not final <= FP8_TOLERANCE:  # also for a NaN loss
        failures.append(f"the FP8 run's final loss is further than {FP8_TOLERANCE:.0%} from "
                        f"the bf16 run's")
    return verdict(failures, f"the final losses agree within {FP8_TOLERANCE:.0%}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--framework", choices=sorted(FRAMEWORKS), required=True)
    parser.add_argument("--steps", type=int,
                        help=f"training steps: {STEPS}, or {FP8_STEPS} with --fp8-attention")
    models = parser.add_mutually_exclusive_group()
    models.add_argument("--packed", action="store_true",
                        help="documents of random lengths packed into rows, attention per "
                             "document (ptxattn.torch.attention_varlen)")
    models.add_argument("--gpt-oss", action="store_true",
                        help="head_dim 64, a sliding window on every other layer, learned sinks")
    models.add_argument("--fp8-attention", action="store_true",
                        help="the default model with ptxattn.torch.fp8_attention against "
                             "ptxattn.torch.attention (bf16)")
    parser.add_argument("--fp8-rotate", action="store_true",
                        help="with --fp8-attention: rotate q and k before quantizing them "
                             "(Fp8Recipe(rotate=True))")
    parser.add_argument("--plot", metavar="FILE.png",
                        help="draw the loss curves into this PNG (needs matplotlib)")
    parser.add_argument("--json", metavar="FILE", help="write the loss curves to this JSON file")
    args = parser.parse_args()
    if args.fp8_rotate and not args.fp8_attention:
        parser.error("--fp8-rotate goes with --fp8-attention")
    if args.fp8_attention and args.framework not in FP8_FRAMEWORKS:
        parser.error(f"--fp8-attention runs on {', '.join(sorted(FP8_FRAMEWORKS))} only")
    # checked before training rather than after it
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        print("train_smoke: --plot needs matplotlib, which is not installed", file=sys.stderr)
        return 2
    if args.fp8_attention:
        from ptxattn.quant.recipe import Fp8Recipe

        return compare_fp8(args.framework, FP8_STEPS if args.steps is None else args.steps,
                           Fp8Recipe("block", rotate=args.fp8_rotate), args.plot, args.json)

    model = "packed" if args.packed else "gpt-oss" if args.gpt_oss else "default"
    try:
        curves = FRAMEWORKS[args.framework](STEPS if args.steps is None else args.steps,
                                            MODELS[model])
    except Unavailable as reason:
        print(f"train_smoke: {reason}", file=sys.stderr)
        return 2

    ref = curves.reference_name
    distances, allowed = drift(curves.ptxattn, curves.reference, curves.naive)
    print(f"{'step':>4} {'ptxattn':>10} {ref:>10} {'naive bf16':>10} "
          f"{'|ptxattn-' + ref + '|':>16} {'|naive-' + ref + '|':>14}")
    for step, losses in enumerate(zip(curves.ptxattn, curves.reference, curves.naive)):
        ours, theirs, naive = losses
        print(f"{step:>4} {ours:>10.5f} {theirs:>10.5f} {naive:>10.5f} "
              f"{abs(ours - theirs):>16.2e} {abs(naive - theirs):>14.2e}")
    exceeded = [step for step, distance in enumerate(distances) if distance > allowed]
    relative = max(d / abs(loss) for d, loss in zip(distances, curves.reference))
    print(f"max |ptxattn - {ref}| = {max(distances):.3e} (relative {relative:.3e}); allowed "
          f"{allowed:.3e} (2 x max |naive bf16 - {ref}|)")
    write_curves({"ptxattn": curves.ptxattn, ref: curves.reference, "naive bf16": curves.naive},
                 ref, f"the {model} model", args.plot, args.json)
    failures = []
    if curves.sinks:
        sink_distances, sinks_allowed = drift(*curves.sinks)
        print(f"trained sinks: max |ptxattn - {ref}| = {max(sink_distances):.3e}; allowed "
              f"{sinks_allowed:.3e}; the furthest a {ref} sink moved from 0: "
              f"{max(abs(s) for s in curves.sinks[1]):.3e}")
        if max(sink_distances) > sinks_allowed:
            failures.append(f"ptxattn's trained sinks are further from {ref}'s than bf16 noise")
    if curves.reference[-1] >= curves.reference[0]:
        failures.append("the loss did not fall, so the curves compare nothing")
    if exceeded:
        failures.append(f"ptxattn's loss is further from {ref}'s than bf16 noise at steps "
                        f"{exceeded}")
    return verdict(failures, "the loss curves agree to bf16 noise")


if __name__ == "__main__":
    sys.exit(main())
