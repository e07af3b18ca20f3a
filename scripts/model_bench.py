"""End-to-end speed of a Llama-3-8B-shaped model on ptxattn and on torch's attentions, in one run.

    python scripts/model_bench.py [--layers 4] [--steps 5] [--decode-tokens 64] [--json FILE]
    python scripts/model_bench.py --tiny        # a small model, also on a CPU (no ptxattn there)

The model: transformers' LlamaForCausalLM with Llama 3 8B's shapes (hidden 4096, 32 query heads
and 8 kv heads of 128, MLP 14336, vocabulary 128256, rope theta 500000) but ``--layers`` layers,
random weights in bfloat16. One model; each attention is switched in with
``set_attn_implementation``, so all of them run the same weights:

    ptxattn             ptxattn.transformers (attn_implementation="ptxattn")
    sdpa-cudnn          "sdpa" under sdpa_kernel(CUDNN_ATTENTION)
    sdpa-flash          "sdpa" under sdpa_kernel(FLASH_ATTENTION)
    flex_attention      "flex_attention", where it compiles

A row that an attention cannot run (an error, e.g. SDPA's flash backend under the dense mask
transformers builds for packed documents) prints "-" and the error on stderr.

Rows: seqlen 4096 (batch 2) and 8192 (batch 1), each plain causal and packed: documents of
random lengths (256 to 2048 tokens, from a fixed seed) back to back in a row, position_ids
restarting at each, so that a token attends within its document only (transformers turns the
restarts into cu_seqlens for ptxattn and into a block-diagonal mask for the others).

Measured, each attention's turn interleaved with the others' in every round (median of
``--steps`` rounds after one warm-up round; wall clock between torch.cuda.synchronize()):

- training tokens/s: a forward, the backward of the mean next-token cross entropy, and an AdamW
  step (fused) over the row's tokens;
- attention share: 1 - (the same step with each attention replaced by a copy of v) / (the step),
  which leaves the projections, norms, MLP and loss as they were;
- prefill: the latency of ``generate(max_new_tokens=1)`` over the plain causal prompt; decode:
  tokens/s of the ``--decode-tokens`` more that ``generate`` makes (batch x new tokens over the
  time past the prefill), greedy, on the dynamic cache.

Exits 2 without torch, transformers or (unless --tiny) a CUDA GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import sys
import time

# This directory's profile.py would shadow the standard library's, which torch imports.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
sys.path.insert(0, os.path.dirname(_HERE))

PROG = "model_bench"


def configs(tiny: bool, layers: int):
    import transformers
    if tiny:
        return transformers.LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512,
                                        num_attention_heads=4, num_key_value_heads=2,
                                        head_dim=64, num_hidden_layers=2,
                                        max_position_embeddings=1024)
    return transformers.LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                                    num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                                    num_hidden_layers=layers, rope_theta=500000.0,
                                    max_position_embeddings=8192)


def rows(tiny: bool) -> list[dict]:
    shapes = [(2, 256), (1, 512)] if tiny else [(2, 4096), (1, 8192)]
    return [dict(batch=batch, seqlen=seqlen, packed=packed)
            for batch, seqlen in shapes for packed in (False, True)]


def document_positions(batch: int, seqlen: int, shortest: int, longest: int, seed: int = 0):
    """position_ids (batch, seqlen) restarting at 0 at each document: documents of random
    lengths in [shortest, longest] back to back, the last cut at seqlen."""
    import torch
    rng = random.Random(seed)
    out = []
    for _ in range(batch):
        positions = []
        while len(positions) < seqlen:
            positions.extend(range(rng.randint(shortest, longest)))
        out.append(positions[:seqlen])
    return torch.tensor(out)


def attentions(device: str) -> dict:
    """name -> (attn_implementation, a context manager to run it under)."""
    import torch
    if device != "cuda":
        return {"eager": ("eager", contextlib.nullcontext), "sdpa": ("sdpa", contextlib.nullcontext)}
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import ptxattn.transformers  # noqa: F401  registers "ptxattn"
    return {"ptxattn": ("ptxattn", contextlib.nullcontext),
            "sdpa-cudnn": ("sdpa", lambda: sdpa_kernel(SDPBackend.CUDNN_ATTENTION)),
            "sdpa-flash": ("sdpa", lambda: sdpa_kernel(SDPBackend.FLASH_ATTENTION)),
            "flex_attention": ("flex_attention", contextlib.nullcontext)}


def register_copy_of_v() -> str:
    """An attention that returns v (each kv head repeated for its query heads) in the layout
    transformers' attention functions return, for the attention share."""
    import transformers

    def copy_of_v(module, query, key, value, attention_mask, **kwargs):
        groups = query.shape[1] // value.shape[1]
        return value.repeat_interleave(groups, dim=1).transpose(1, 2).contiguous(), None

    transformers.AttentionInterface.register("bench_copy_of_v", copy_of_v)
    transformers.AttentionMaskInterface.register(
        "bench_copy_of_v", transformers.masking_utils.ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    return "bench_copy_of_v"


def synchronized(device: str):
    import torch

    def wait():
        if device == "cuda":
            torch.cuda.synchronize()
    return wait


def time_rounds(calls: dict, rounds: int, wait) -> dict:
    """Median seconds of each call over ``rounds`` rounds (after a warm-up round), the calls of
    a round in a shuffled order. A call that raises is dropped, its error on stderr."""
    times = {name: [] for name in calls}
    order = list(calls)
    rng = random.Random(0)
    for round_index in range(rounds + 1):
        rng.shuffle(order)
        for name in order:
            if name not in times:
                continue
            try:
                wait()
                start = time.perf_counter()
                calls[name]()
                wait()
            except Exception as err:  # noqa: BLE001 - an attention that cannot run this row
                print(f"{PROG}: {name}: {type(err).__name__}: {str(err).splitlines()[0]}",
                      file=sys.stderr)
                del times[name]
                continue
            if round_index:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items() if t}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5, help="timed rounds (default 5)")
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--tiny", action="store_true", help="a small model (runs on a CPU too)")
    parser.add_argument("--json", help="write the rows to this JSON file")
    args = parser.parse_args(argv)
    try:
        import torch
        import transformers  # noqa: F401
    except ImportError as err:
        print(f"{PROG}: needs torch and transformers ({err})", file=sys.stderr)
        return 2
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not args.tiny:
        print(f"{PROG}: no CUDA GPU (--tiny runs a small model on the CPU)", file=sys.stderr)
        return 2
    wait = synchronized(device)
    torch.manual_seed(0)
    config = configs(args.tiny, args.layers)
    model = transformers.LlamaForCausalLM._from_config(config, dtype=torch.bfloat16).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device == "cuda")
    kinds = attentions(device)
    copy_of_v = register_copy_of_v()
    where = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    shape = "a tiny Llama" if args.tiny else "Llama-3-8B-shaped"
    print(f"# {where}, {shape} x {config.num_hidden_layers} layers "
          f"({sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters), bfloat16, "
          f"median of {args.steps}")

    def switched(implementation, context, fn):
        def run():
            model.set_attn_implementation(implementation)
            with context():
                fn()
        return run

    results = []
    for row in rows(args.tiny):
        batch, seqlen = row["batch"], row["seqlen"]
        ids = torch.randint(0, config.vocab_size, (batch, seqlen),
                            generator=torch.Generator().manual_seed(1)).to(device)
        extra = {}
        if row["packed"]:
            shortest, longest = (16, 128) if args.tiny else (256, 2048)
            extra["position_ids"] = document_positions(batch, seqlen, shortest, longest).to(device)

        def step():
            out = model(ids, labels=ids, use_cache=False, **extra)
            out.loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        calls = {name: switched(impl, ctx, step) for name, (impl, ctx) in kinds.items()}
        calls["copy of v"] = switched(copy_of_v, contextlib.nullcontext, step)
        step_s = time_rounds(calls, args.steps, wait)
        result = dict(row, train_tokens_per_s={n: batch * seqlen / s for n, s in step_s.items()
                                               if n != "copy of v"})
        if "copy of v" in step_s:
            result["attention_share"] = {n: 1 - step_s["copy of v"] / s
                                         for n, s in step_s.items() if n != "copy of v"}
        if not row["packed"]:
            prompt = ids[:, : seqlen - args.decode_tokens]

            def generate(tokens):
                def run():
                    with torch.no_grad():
                        model.generate(prompt, max_new_tokens=tokens, min_new_tokens=tokens,
                                       do_sample=False, use_cache=True, pad_token_id=0)
                return run
            prefill = time_rounds({name: switched(impl, ctx, generate(1))
                                   for name, (impl, ctx) in kinds.items()}, args.steps, wait)
            total = time_rounds({name: switched(impl, ctx, generate(1 + args.decode_tokens))
                                 for name, (impl, ctx) in kinds.items()}, args.steps, wait)
            result["prefill_ms"] = {n: 1e3 * s for n, s in prefill.items()}
            result["decode_tokens_per_s"] = {n: batch * args.decode_tokens / (total[n] - s)
                                             for n, s in prefill.items() if n in total}
        results.append(result)
        del step
    names = list(kinds)
    print(f"{'batch':>5} {'seqlen':>6} {'packed':>6}  " + "  ".join(f"{n:>26}" for n in names))
    print(f"{'':21}" + "  ".join(f"{'train tok/s (attn share)':>26}" for _ in names))
    for r in results:
        cells = []
        for n in names:
            if n in r["train_tokens_per_s"]:
                share = r.get("attention_share", {}).get(n)
                cells.append(f"{r['train_tokens_per_s'][n]:17.0f} ({share:5.1%})"
                             if share is not None else f"{r['train_tokens_per_s'][n]:26.0f}")
            else:
                cells.append(f"{'-':>26}")
        print(f"{r['batch']:5d} {r['seqlen']:6d} {str(r['packed']):>6}  " + "  ".join(cells))
    print(f"{'':21}" + "  ".join(f"{'prefill ms / decode tok/s':>26}" for _ in names))
    for r in results:
        if "prefill_ms" not in r:
            continue
        cells = [f"{r['prefill_ms'][n]:12.1f} / {r['decode_tokens_per_s'][n]:11.1f}"
                 if n in r["prefill_ms"] and n in r["decode_tokens_per_s"] else f"{'-':>26}"
                 for n in names]
        print(f"{r['batch']:5d} {r['seqlen']:6d} {'':>6}  " + "  ".join(cells))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": where, "layers": config.num_hidden_layers, "rows": results}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
