"""ptxattn.transformers: transformers models on attn_implementation="ptxattn".

CPU only: the registration (from_config and set_attn_implementation take "ptxattn", with the
flash-attention mask function registered under it), the window transformers' sliding_window
becomes (it leaves visible the keys transformers' own sliding-window masks leave), the padding
mask's indices and cu_seqlens, where packed sequences start, a value head_dim below the
query's reaching the kernels as it is (zero-padded to a multiple of 8 if it is none, the output
cropped), and the errors that name the model's feature (a 4D or float mask, attention dropout
in training, a head_dim of 100, a value head_dim over the query's, packed position_ids against
a cache, float32 outside autocast). The public names follow tests/test_public_api.py's
docstring rules.

Models, tiny and random (1-2 layers, hidden 256, built from configs: no downloads), their attention
sharpened (query and key projections scaled up, gpt-oss's sinks drawn large) so that a wrong mask,
window, softcap or sink shows: Llama (GQA, head_dim 128), Mistral (sliding window), Qwen3 (q/k
norms), Gemma 2 (softcap and window, head_dim 256), Gemma 3 (local and global layers), gpt-oss
(sinks and window, head_dim 64; it and DeepSeek-V3 route every token through all their experts,
since a top-k router's choice follows rounding), Phi-3 (head_dim 96, between the compiled ones),
DeepSeek-V3 (multi-head latent attention: value head_dim 32 under 64), a BERT encoder with right padding, a BERT decoder cross-attending to padded encoder
states, Whisper (encoder, causal decoder, cross-attention). Each test runs twice: on the GPU with
ptxattn's kernels in bfloat16, and on the CPU in float16 with the two ptxattn.torch functions
replaced by their math in torch (_reference_attention), which tests everything ptxattn.transformers
does around the kernels. Logits of batches with and without padding and the gradients of a loss with
respect to every parameter; greedy generate() with the dynamic and a static cache, its logits step
by step against the same tokens teacher-forced; a prefill in two chunks; packed sequences
(position_ids restarting, or the cu_seq_lens_q/k and max_length_q/k keywords) against each sequence
run alone; a float32 model under autocast. One rule holds them: against the model in float32 on
"eager" attention, ptxattn's max error is at most twice that of the model in 16 bits on the baseline
attention ("sdpa"; "eager" for Gemma 2, whose softcap sdpa drops, and gpt-oss, which has no sdpa),
plus twice the rounding noise of one 16-bit value; four times for a tensor of fewer than 64 values
(gpt-oss's sinks' gradient), whose max error estimates either's poorly.
"""

import dataclasses
import math
from typing import Callable

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")
transformers = pytest.importorskip("transformers", reason="transformers is not installed")

import ptxattn.torch  # noqa: E402  after the skips: these import torch and transformers
import ptxattn.transformers  # noqa: E402
from ptxattn.transformers import (_packed_sequence_starts, _unpad_data,  # noqa: E402
                                  _window)

VOCAB = 256
# The 16-bit dtype each device runs the models in: on the CPU float16, whose finer rounding (10
# bits to bfloat16's 7) lets the runs there see small mistakes in the masks.
DTYPES = {"cpu": torch.float16, "cuda": torch.bfloat16}


# ---------------------------------------------------------------------------------------------
# The models


@dataclasses.dataclass(frozen=True)
class Case:
    config: Callable[[], "transformers.PretrainedConfig"]
    model_class: str            # the transformers class, by name
    baseline: str = "sdpa"      # the 16-bit attention ptxattn's error is held to
    padding: str = "left"       # where a padded batch's padding goes
    kind: str = "decoder"       # "decoder", "encoder", "cross" (BERT decoder) or "whisper"


_SMALL = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
              pad_token_id=0, bos_token_id=1, eos_token_id=None, tie_word_embeddings=False)
_BERT = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
             num_attention_heads=4, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
             pad_token_id=0)

CASES = {
    "llama": Case(lambda: transformers.LlamaConfig(**_SMALL, num_attention_heads=4,
                                                   num_key_value_heads=2, head_dim=128),
                  "LlamaForCausalLM"),
    "mistral": Case(lambda: transformers.MistralConfig(**_SMALL, num_attention_heads=4,
                                                       num_key_value_heads=2, head_dim=64,
                                                       sliding_window=32),
                    "MistralForCausalLM"),
    "qwen3": Case(lambda: transformers.Qwen3Config(**_SMALL, num_attention_heads=4,
                                                   num_key_value_heads=2, head_dim=64),
                  "Qwen3ForCausalLM"),
    # Layer 0 slides a window of 32, layer 1 sees everything; a softcap the scores reach.
    "gemma2": Case(lambda: transformers.Gemma2Config(**_SMALL, num_attention_heads=2,
                                                     num_key_value_heads=1, head_dim=256,
                                                     query_pre_attn_scalar=256,
                                                     sliding_window=32,
                                                     attn_logit_softcapping=3.0,
                                                     final_logit_softcapping=30.0),
                   "Gemma2ForCausalLM", baseline="eager"),
    # Gemma 3: q/k norms instead of the softcap; layer 0 local (a window of 32), layer 1 global.
    "gemma3": Case(lambda: transformers.Gemma3TextConfig(
        **_SMALL, num_attention_heads=2, num_key_value_heads=1, head_dim=256,
        query_pre_attn_scalar=256, sliding_window=32,
        layer_types=["sliding_attention", "full_attention"]),
        "Gemma3ForCausalLM"),
    # Every expert a token (num_experts_per_tok = the experts): a top-k router is discontinuous,
    # and its choice between two experts whose logits lie 0.002 apart (the random model's
    # closest, at the packed test's tokens) follows the attention's rounding, so a 16-bit model
    # that routes one token otherwise than the float32 one puts a max error of the experts'
    # difference on that token, whichever attention it runs. Over all experts the router is a
    # smooth function of the attention's output, and the models differ by their arithmetic.
    "gpt_oss": Case(lambda: transformers.GptOssConfig(**{**_SMALL, "intermediate_size": 256},
                                                      num_attention_heads=4,
                                                      num_key_value_heads=2, head_dim=64,
                                                      num_local_experts=4,
                                                      num_experts_per_tok=4,
                                                      sliding_window=32),
                    "GptOssForCausalLM", baseline="eager"),
    # head_dim 96 (hidden 192 over 2 heads, as Phi-3's 3072 over 32): between compiled ones.
    "phi3": Case(lambda: transformers.Phi3Config(**{**_SMALL, "hidden_size": 192},
                                                 num_attention_heads=2, num_key_value_heads=2),
                 "Phi3ForCausalLM"),
    # Multi-head latent attention: query and key head_dim 64 (32 + 32 rotary), value 32.
    # Every routed expert a token, as for gpt-oss.
    "deepseek_v3": Case(lambda: transformers.DeepseekV3Config(
        **_SMALL, moe_intermediate_size=128, num_attention_heads=4, num_key_value_heads=4,
        n_shared_experts=1, n_routed_experts=4, num_experts_per_tok=4, n_group=1, topk_group=1,
        first_k_dense_replace=1, kv_lora_rank=64, q_lora_rank=None, qk_nope_head_dim=32,
        qk_rope_head_dim=32, v_head_dim=32),
        "DeepseekV3ForCausalLM"),
    "bert": Case(lambda: transformers.BertConfig(**_BERT), "BertForMaskedLM", padding="right",
                 kind="encoder"),
    "bert_cross": Case(lambda: transformers.BertConfig(**_BERT, is_decoder=True,
                                                       add_cross_attention=True),
                       "BertLMHeadModel", padding="right", kind="cross"),
    "whisper": Case(lambda: transformers.WhisperConfig(
        vocab_size=VOCAB, d_model=256, encoder_layers=1, decoder_layers=1,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=512,
        decoder_ffn_dim=512, num_mel_bins=16, max_source_positions=64,
        max_target_positions=128, pad_token_id=0, bos_token_id=1, eos_token_id=None,
        decoder_start_token_id=1, suppress_tokens=None, begin_suppress_tokens=None),
        "WhisperForConditionalGeneration", kind="whisper"),
}
DECODERS = ["llama", "mistral", "qwen3", "gemma2", "gemma3", "gpt_oss", "phi3", "deepseek_v3"]


def _sharpen(model, generator) -> None:
    """Peaked attention, so that the mask, the window, the softcap and the sinks change the
    result well beyond rounding: at their random initialization the scores are about 0.1 and
    every key gets about the same weight. The query and key projections are scaled by 4 (the
    scores by 16), Qwen3's q/k norms (which undo that) by 1.5, and gpt-oss's sinks drawn from
    [2, 5], so that they take a share of every row."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight", "query.weight", "key.weight")):
                p.mul_(4)
            elif name.endswith(("q_norm.weight", "k_norm.weight")):
                p.mul_(1.5)
            elif name.endswith(".sinks"):
                p.copy_(torch.rand(p.shape, generator=generator) * 3 + 2)


def _models(case: Case, device: str):
    """The same random weights three times: on ptxattn and on the baseline in the device's
    16-bit dtype, and on eager attention in float32 (the reference), all in eval mode. Mixtures
    of experts run their experts in plain torch ops, alike in every dtype and on every device."""
    torch.manual_seed(0)
    cls = getattr(transformers, case.model_class)
    reference = cls._from_config(case.config(), attn_implementation="eager",
                                 experts_implementation="eager", dtype=torch.float32)
    _sharpen(reference, torch.Generator().manual_seed(1))
    state = reference.state_dict()
    models = {}
    for name, implementation in (("ptxattn", "ptxattn"), ("baseline", case.baseline)):
        model = cls._from_config(case.config(), attn_implementation=implementation,
                                 experts_implementation="eager", dtype=DTYPES[device])
        model.load_state_dict(state)
        models[name] = model.to(device).eval()
    models["reference"] = reference.to(device).eval()
    return models


def _inputs(case: Case, device: str, padded: bool, seqlen: int = 96) -> dict:
    """A batch of two: token ids (and a padding mask, the second sequence 37 tokens shorter,
    when ``padded``), as ``case.kind`` takes them; Whisper's encoder gets random features."""
    g = torch.Generator().manual_seed(2)
    batch = 2
    ids = torch.randint(3, VOCAB, (batch, seqlen), generator=g)
    inputs = {}
    if padded:
        mask = torch.ones(batch, seqlen, dtype=torch.long)
        if case.padding == "left":
            mask[1, :37] = 0
        else:
            mask[1, -37:] = 0
        ids = ids.masked_fill(mask == 0, 0)
        inputs["attention_mask"] = mask
    if case.kind == "whisper":
        frames = 2 * 64  # the encoder's convolutions halve it to max_source_positions
        inputs["input_features"] = torch.randn(batch, 16, frames, generator=g)
        inputs["decoder_input_ids"] = ids[:, :32]
        inputs.pop("attention_mask", None)
    else:
        inputs["input_ids"] = ids
    if case.kind == "cross":
        encoder_length = 48
        inputs["encoder_hidden_states"] = torch.randn(batch, encoder_length, 256, generator=g)
        encoder_mask = torch.ones(batch, encoder_length, dtype=torch.long)
        encoder_mask[0, -11:] = 0
        inputs["encoder_attention_mask"] = encoder_mask
    return {name: x.to(device) for name, x in inputs.items()}


def _cast(inputs: dict, model) -> dict:
    """``inputs`` with its float tensors (Whisper's features, encoder states) in the model's
    dtype."""
    dtype = next(model.parameters()).dtype
    return {name: x.to(dtype) if x.is_floating_point() else x for name, x in inputs.items()}


def _tokens(inputs: dict):
    """Which logits rows are real tokens: a (batch, seqlen) bool mask."""
    ids = inputs.get("decoder_input_ids", inputs.get("input_ids"))
    mask = inputs.get("attention_mask")
    return torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.bool()


def _noise(ref: torch.Tensor, dtype: torch.dtype) -> float:
    """The rounding error of one ``dtype`` value at the reference's magnitudes."""
    return float((ref.to(dtype).float() - ref).abs().max())


def _assert_within_baseline_error(ours, baseline, ref, dtype, what: str) -> None:
    """Against the float32 reference, ours' max error at most twice the baseline's plus twice
    the rounding noise of ``dtype``; four times for fewer than 64 values (gpt-oss's sinks,
    4 a layer), whose max error is a poor estimate of either's: their gradients are sums over
    every row, and ours and the baseline's take turns being the closer."""
    ours, baseline, ref = (x.detach().float() for x in (ours, baseline, ref))
    assert bool(torch.isfinite(ours).all()), f"{what}: NaN or Inf"
    err = float((ours - ref).abs().max())
    baseline_err = float((baseline - ref).abs().max())
    noise = _noise(ref, dtype)
    factor = 2 if ref.numel() >= 64 else 4
    assert err <= factor * (baseline_err + noise) + 1e-6, (what, err, baseline_err, noise)


def _assert_gradients_within_baseline_error(grads: dict, dtype, what: str) -> None:
    """Every parameter's gradient (``grads[model][parameter]``) by the rule of
    _assert_within_baseline_error; a parameter without one in the reference has none in
    ours."""
    for param, ref in grads["reference"].items():
        ours = grads["ptxattn"][param]
        assert (ours is None) == (ref is None), param
        if ref is not None:
            _assert_within_baseline_error(ours, grads["baseline"][param], ref, dtype,
                                          f"{what} d/d {param}")


def _loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the real tokens' logits against fixed random targets, in float32."""
    targets = torch.randint(0, VOCAB, tokens.shape, generator=torch.Generator().manual_seed(3))
    targets = targets.to(logits.device)
    return torch.nn.functional.cross_entropy(logits[tokens].float(), targets[tokens])


# ---------------------------------------------------------------------------------------------
# The kernels' math in torch, for the CPU runs


def _reference_attention(q, k, v, *, causal=False, softmax_scale=None, window=(-1, -1),
                         softcap=0.0, sinks=None, deterministic=False, return_lse=False,
                         backend=None):
    """ptxattn.torch.attention's math in float32 torch ops, differentiable: (batch, seqlen,
    heads, dim), bottom-right aligned causal and window, GQA, softcap, sinks."""
    seqlen_q, heads_q, head_dim = q.shape[1:]
    seqlen_k, heads_kv = k.shape[1:3]
    scale = 1 / math.sqrt(head_dim) if softmax_scale is None else softmax_scale
    kf = k.float().repeat_interleave(heads_q // heads_kv, dim=2)
    vf = v.float().repeat_interleave(heads_q // heads_kv, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q.float(), kf) * scale
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    # key j's distance past query i's diagonal, bottom-right aligned
    offset = (torch.arange(seqlen_k)[None, :] - torch.arange(seqlen_q)[:, None]
              - (seqlen_k - seqlen_q)).to(q.device)
    left, right = window
    right = 0 if causal else right
    visible = torch.ones_like(offset, dtype=torch.bool)
    if right >= 0:
        visible &= offset <= right
    if left >= 0:
        visible &= offset >= -left
    scores = scores.masked_fill(~visible, -math.inf)
    if sinks is not None:
        sink = sinks.float()[None, :, None, None].expand(*scores.shape[:3], 1)
        scores = torch.cat([scores, sink], dim=-1)
    weights = torch.softmax(scores, dim=-1).nan_to_num()[..., :seqlen_k]
    return torch.einsum("bhqk,bkhd->bqhd", weights, vf).to(q.dtype)


def _reference_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                max_seqlen_k, *, check_contents=True, **options):
    """ptxattn.torch.attention_varlen's math, sequence by sequence, with its argument rules:
    int32 cu_seqlens, int bounds that hold."""
    assert cu_seqlens_q.dtype == cu_seqlens_k.dtype == torch.int32
    assert isinstance(max_seqlen_q, int) and isinstance(max_seqlen_k, int)
    lengths_q, lengths_k = cu_seqlens_q.diff(), cu_seqlens_k.diff()
    assert int(lengths_q.max()) <= max_seqlen_q and int(lengths_k.max()) <= max_seqlen_k
    assert cu_seqlens_q[-1] == q.shape[0] and cu_seqlens_k[-1] == k.shape[0]
    parts = []
    for i in range(len(lengths_q)):
        sq = slice(int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1]))
        sk = slice(int(cu_seqlens_k[i]), int(cu_seqlens_k[i + 1]))
        parts.append(_reference_attention(q[None, sq], k[None, sk], v[None, sk], **options)[0])
    return torch.cat(parts)


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request, monkeypatch):
    """"cuda": ptxattn's kernels; "cpu": the same math in torch in their place."""
    if request.param == "cpu":
        monkeypatch.setattr(ptxattn.torch, "attention", _reference_attention)
        monkeypatch.setattr(ptxattn.torch, "attention_varlen", _reference_attention_varlen)
    return request.param


# ---------------------------------------------------------------------------------------------
# Logits, gradients, generation, packing


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
@pytest.mark.parametrize("name", CASES)
def test_logits_and_gradients_within_twice_the_baselines_error(name, padded, device):
    case = CASES[name]
    if padded and case.kind == "whisper":
        pytest.skip("Whisper's encoder takes no padding mask")
    models = _models(case, device)
    inputs = _inputs(case, device, padded)
    tokens = _tokens(inputs)
    logits, grads = {}, {}
    for which, model in models.items():
        model.zero_grad()
        out = model(**_cast(inputs, model), use_cache=False).logits
        _loss(out, tokens).backward()
        logits[which] = out[tokens]
        grads[which] = {n: p.grad for n, p in model.named_parameters()}
    _assert_within_baseline_error(logits["ptxattn"], logits["baseline"], logits["reference"],
                                  DTYPES[device], f"{name} logits")
    _assert_gradients_within_baseline_error(grads, DTYPES[device], name)


def _teacher_forced_logits(model, sequences, inputs: dict, steps: int):
    """The logits a model gives the last ``steps`` tokens of generate()'s ``sequences`` when
    the whole sequences are its input (no cache), at the positions generate() gives them
    (counted from each sequence's first token)."""
    if "input_features" in inputs:
        return model(**_cast(inputs, model), decoder_input_ids=sequences[:, :-1],
                     use_cache=False).logits[:, -steps:]
    prompt_mask = inputs["attention_mask"]
    mask = torch.cat([prompt_mask, prompt_mask.new_ones(prompt_mask.shape[0], steps)], dim=1)
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    logits = model(sequences, attention_mask=mask, position_ids=positions,
                   use_cache=False).logits
    return logits[:, -steps - 1:-1]


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("name", DECODERS + ["whisper"])
def test_generate_logits_step_by_step_within_twice_the_baselines_error(name, cache, device):
    """Greedy generate(), 16 steps, with the dynamic cache or a static one (whose keys run past
    the mask, to the cache's length): for the decoders over a left-padded batch (a prefill of 48
    tokens, beyond the sliding windows, then decode steps of one query against the cache), for
    Whisper from its encoder's states (a causal decoder, and one query cross-attending to 64
    encoder states a step). Its step-by-step logits against those the baseline and the
    reference give the same tokens teacher-forced."""
    case = CASES[name]
    if case.kind == "whisper" and cache == "static":
        pytest.skip("the static cache is tested on the decoders")
    models = _models(case, device)
    steps = 16
    if case.kind == "whisper":
        inputs = {"input_features": _inputs(case, device, padded=False)["input_features"]}
    else:
        inputs = _inputs(case, device, padded=True, seqlen=48)
    with torch.no_grad():
        out = models["ptxattn"].generate(**_cast(inputs, models["ptxattn"]),
                                         max_new_tokens=steps, do_sample=False,
                                         cache_implementation=cache, output_logits=True,
                                         return_dict_in_generate=True)
        assert len(out.logits) == steps
        ours = torch.stack(out.logits, dim=1)
        baseline, reference = (_teacher_forced_logits(models[which], out.sequences, inputs,
                                                      steps)
                               for which in ("baseline", "reference"))
    _assert_within_baseline_error(ours, baseline, reference, DTYPES[device],
                                  f"{name} generate logits")


@pytest.mark.parametrize("name", ["llama", "mistral"])
def test_prefill_in_two_chunks_within_twice_the_baselines_error(name, device):
    """A left-padded batch prefilled in two chunks, 32 tokens and then 16 against the cache of
    the first (Mistral's keeping only its window): the second chunk's queries are the mask's
    last columns, and the padded sequence has no token in the first chunk."""
    models = _models(CASES[name], device)
    inputs = _inputs(CASES[name], device, padded=True, seqlen=48)
    ids, mask = inputs["input_ids"], inputs["attention_mask"]
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    logits = {}
    with torch.no_grad():
        for which, model in models.items():
            cache = transformers.DynamicCache(config=model.config)
            model(ids[:, :32], attention_mask=mask[:, :32], position_ids=positions[:, :32],
                  past_key_values=cache)
            out = model(ids[:, 32:], attention_mask=mask, position_ids=positions[:, 32:],
                        past_key_values=cache).logits
            logits[which] = out[mask[:, 32:].bool()]
    _assert_within_baseline_error(logits["ptxattn"], logits["baseline"], logits["reference"],
                                  DTYPES[device], f"{name} second chunk logits")


@pytest.mark.parametrize("packing", ["position_ids", "cu_seq_lens"])
@pytest.mark.parametrize("name", ["llama", "gpt_oss"])
def test_packed_sequences_within_twice_the_baselines_error(name, packing, device):
    """Three sequences (40, 50 and 38 tokens) packed into a batch of one for ptxattn, through
    position_ids restarting at 0 or through DataCollatorWithFlattening's keywords alone; the
    baseline and the reference run each sequence by itself (gpt-oss builds its sdpa and eager
    masks without the position_ids, so that they would attend across the packed sequences)."""
    models = _models(CASES[name], device)
    lengths = [40, 50, 38]
    ids = torch.randint(3, VOCAB, (1, sum(lengths)), generator=torch.Generator().manual_seed(4))
    ids = ids.to(device)
    cu_seqlens = torch.tensor([0, 40, 90, 128], dtype=torch.int32, device=device)
    if packing == "position_ids":
        packed = {"position_ids": torch.cat([torch.arange(n) for n in lengths])[None].to(device)}
    else:
        packed = {"cu_seq_lens_q": cu_seqlens, "cu_seq_lens_k": cu_seqlens,
                  "max_length_q": 50, "max_length_k": 50}
    tokens = torch.ones(1, sum(lengths), dtype=torch.bool, device=device)
    logits, grads = {}, {}
    for which, model in models.items():
        if which == "ptxattn":
            out = model(ids, use_cache=False, **packed).logits
        else:
            out = torch.cat([model(ids[:, a:b], use_cache=False).logits
                             for a, b in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())],
                            dim=1)
        _loss(out, tokens).backward()
        logits[which] = out[0]
        grads[which] = {n: p.grad for n, p in model.named_parameters()}
    _assert_within_baseline_error(logits["ptxattn"], logits["baseline"], logits["reference"],
                                  DTYPES[device], f"{name} packed logits")
    _assert_gradients_within_baseline_error(grads, DTYPES[device], f"{name} packed")


def test_autocast_runs_a_float32_model_in_16_bits(device):
    """A float32 model under torch.autocast: the queries and keys come out of the rotary
    embedding in float32, and are cast to autocast's dtype, as transformers' flash integration
    does. The baseline: the float32 eager model under the same autocast."""
    case = CASES["llama"]
    reference = _models(case, device)["reference"]
    ours = getattr(transformers, case.model_class)._from_config(
        case.config(), attn_implementation="ptxattn", dtype=torch.float32)
    ours.load_state_dict(reference.state_dict())
    ours = ours.to(device).eval()
    inputs = _inputs(case, device, padded=True)
    tokens = _tokens(inputs)
    logits = {}
    with torch.no_grad():
        with torch.autocast(device, dtype=DTYPES[device]):
            logits["ptxattn"] = ours(**inputs, use_cache=False).logits[tokens]
            logits["baseline"] = reference(**inputs, use_cache=False).logits[tokens]
        logits["reference"] = reference(**inputs, use_cache=False).logits[tokens]
    _assert_within_baseline_error(logits["ptxattn"], logits["baseline"], logits["reference"],
                                  DTYPES[device], "autocast logits")


# ---------------------------------------------------------------------------------------------
# The conversions (CPU)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("seqlen_q, seqlen_k", [(40, 40), (1, 40), (8, 40), (32, 32), (1, 20)])
def test_window_leaves_visible_the_keys_transformers_sliding_mask_does(causal, seqlen_q,
                                                                       seqlen_k):
    """_window(32, ...) as ptxattn reads it (bottom-right aligned, causal or not), against
    transformers' mask functions for sliding_window 32 at the queries' positions (the last
    seqlen_q of seqlen_k tokens): causal, the 32 keys up to the query's own; bidirectional, 31
    each side (transformers' flash convention, which its encoders' sliding_window allows for)."""
    from transformers import masking_utils as mu

    sliding_window = 32
    left, right = _window(sliding_window, causal, seqlen_k)
    if causal:
        expected = mu.and_masks(mu.causal_mask_function,
                                mu.sliding_window_overlay(sliding_window))
    else:
        expected = mu.sliding_window_bidirectional_overlay(sliding_window - 1)
    q_offset = seqlen_k - seqlen_q
    for i in range(seqlen_q):
        for j in range(seqlen_k):
            distance = j - (i + q_offset)  # past the query's diagonal
            ours = ((distance <= 0 or not causal) and (left < 0 or distance >= -left)
                    and (right < 0 or distance <= right))
            want = bool(expected(0, 0, torch.tensor(i + q_offset), torch.tensor(j)))
            assert ours == want, (i, j, left, right)


def test_window_is_transformers_flash_window():
    assert _window(None, True, 1000) == (-1, -1)
    assert _window(4096, True, 4096) == (-1, -1)
    assert _window(4096, True, 4097) == (4095, 0)
    assert _window(128, False, 200) == (127, 127)


def test_padding_mask_gives_indices_and_cu_seqlens():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [0, 0, 0, 0, 0]],
                        dtype=torch.bool)
    indices, cu_seqlens, max_seqlen = _unpad_data(mask)
    assert indices.tolist() == [2, 3, 4, 5, 6, 7, 8, 9, 10, 11]
    assert cu_seqlens.dtype == torch.int32
    assert cu_seqlens.tolist() == [0, 3, 8, 10, 10]
    assert max_seqlen == 5 and isinstance(max_seqlen, int)


def test_packed_sequence_starts_as_transformers_reads_position_ids():
    q = torch.empty(1, 7, 2, 64)
    starts = _packed_sequence_starts(torch.tensor([[0, 1, 2, 0, 1, 0, 1]]), q)
    assert starts.dtype == torch.int32 and starts.tolist() == [0, 3, 5]
    # one sequence, however it is counted; a batch of two; a decode step
    assert _packed_sequence_starts(torch.tensor([[5, 6, 7, 8, 9, 10, 11]]), q) is None
    assert _packed_sequence_starts(torch.tensor([[0, 1, 0, 1, 2, 3, 4]] * 2),
                                   torch.empty(2, 7, 2, 64)) is None
    assert _packed_sequence_starts(torch.tensor([[7]]), torch.empty(1, 1, 2, 64)) is None
    assert _packed_sequence_starts(None, q) is None


# ---------------------------------------------------------------------------------------------
# Registration and errors (CPU: each raises before any kernel would run)


def test_registered_with_attention_and_mask_interfaces():
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, flash_attention_mask
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    ptxattn.transformers.register()  # again: changes nothing
    assert ALL_ATTENTION_FUNCTIONS["ptxattn"] is ptxattn.transformers.attention_forward
    assert ALL_MASK_ATTENTION_FUNCTIONS["ptxattn"] is flash_attention_mask
    model = transformers.AutoModelForCausalLM.from_config(CASES["llama"].config(),
                                                          attn_implementation="ptxattn")
    assert model.config._attn_implementation == "ptxattn"
    model.set_attn_implementation("sdpa")
    model.set_attn_implementation("ptxattn")
    assert model.config._attn_implementation == "ptxattn"


def _tiny(name: str, dtype=torch.float16, **config):
    case = CASES[name]
    cfg = case.config()
    for key, value in config.items():
        setattr(cfg, key, value)
    return getattr(transformers, case.model_class)._from_config(
        cfg, attn_implementation="ptxattn", dtype=dtype)


def test_a_head_dim_ptxattn_does_not_run_is_a_clear_error():
    """head_dim 100 (hidden 200 over 2 heads): no multiple of 8, which ptxattn's kernels need."""
    config = transformers.Phi3Config(**{**_SMALL, "hidden_size": 200}, num_attention_heads=2,
                                     num_key_value_heads=2)
    model = transformers.Phi3ForCausalLM._from_config(config, attn_implementation="ptxattn",
                                                      dtype=torch.float16)
    with pytest.raises(ValueError, match=r"Phi3Attention has head_dim 100 .*ptxattn runs "
                                         r"head_dim a multiple of 8 from 8 to 256"):
        model(torch.ones(1, 8, dtype=torch.long))


def test_4d_mask_is_a_clear_error():
    model = _tiny("llama")
    mask = torch.zeros(1, 1, 8, 8, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"4D attention mask .* padding masks only"):
        model(torch.ones(1, 8, dtype=torch.long), attention_mask=mask)


def test_float_2d_mask_is_a_clear_error():
    query = torch.empty(1, 2, 8, 64, dtype=torch.float16)
    with pytest.raises(TypeError, match="bool or integer mask"):
        ptxattn.transformers.attention_forward(torch.nn.Module(), query, query, query,
                                               torch.zeros(1, 8))


def test_attention_dropout_in_training_is_a_clear_error():
    model = _tiny("llama", attention_dropout=0.1).train()
    with pytest.raises(ValueError, match=r"attention dropout 0.1 .* training mode"):
        model(torch.ones(1, 8, dtype=torch.long))


class _CausalLayer(torch.nn.Module):
    is_causal = True


def test_packed_position_ids_against_a_longer_cache_is_a_clear_error():
    query = torch.empty(1, 2, 4, 64, dtype=torch.float16)
    key = torch.empty(1, 2, 6, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"4 queries but 6 keys"):
        ptxattn.transformers.attention_forward(_CausalLayer(), query, key, key, None,
                                               position_ids=torch.tensor([[0, 1, 0, 1]]))


def test_a_value_head_dim_over_the_querys_is_a_clear_error():
    query = torch.empty(1, 2, 8, 64, dtype=torch.float16)
    value = torch.empty(1, 2, 8, 128, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"_CausalLayer has head_dim 64 \(value head_dim "
                                         r"128\).*at most the query's"):
        ptxattn.transformers.attention_forward(_CausalLayer(), query, query, value, None)


@pytest.mark.parametrize("value_head_dim", [32, 36])
def test_a_narrower_value_runs_as_it_is_or_padded_to_a_multiple_of_8(value_head_dim,
                                                                      monkeypatch):
    """The kernels get v as it is when its head_dim is a multiple of 8, else zero-padded up to
    one; the output has v's own head_dim, the padding cropped."""
    given = []

    def recorded(q, k, v, **options):
        given.append(v.shape[-1])
        return _reference_attention(q, k, v, **options)

    monkeypatch.setattr(ptxattn.torch, "attention", recorded)
    g = torch.Generator().manual_seed(4)
    query, key = (torch.randn(2, 4, 16, 64, generator=g).half() for _ in range(2))
    value = torch.randn(2, 4, 16, value_head_dim, generator=g).half()
    out, weights = ptxattn.transformers.attention_forward(_CausalLayer(), query, key, value,
                                                          None)
    assert given == [-(-value_head_dim // 8) * 8] and weights is None
    assert out.shape == (2, 16, 4, value_head_dim)
    expected = _reference_attention(*(x.transpose(1, 2) for x in (query, key, value)),
                                    causal=True)
    torch.testing.assert_close(out, expected)


def test_float32_outside_autocast_is_a_clear_error():
    model = _tiny("llama", dtype=torch.float32)
    with pytest.raises(TypeError, match=r"float32 query, key and value.*dtype=torch.bfloat16"):
        model(torch.ones(1, 8, dtype=torch.long))
