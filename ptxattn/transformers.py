"""ptxattn as a Hugging Face transformers attention backend: ``attn_implementation="ptxattn"``.
Imported only as ``ptxattn.transformers`` (it imports torch and transformers); importing it
registers the backend.

    import ptxattn.transformers
    model = AutoModelForCausalLM.from_config(config, attn_implementation="ptxattn",
                                             dtype=torch.bfloat16).cuda()
    model.set_attn_implementation("ptxattn")   # or switch a loaded model over

``register()`` puts ``attention_forward`` into transformers' ``AttentionInterface`` under the
name "ptxattn", and transformers' flash-attention mask function into its
``AttentionMaskInterface`` under the same name: the models then build for ptxattn what they
build for flash attention, a 2D (batch, seqlen_k) padding mask or None, never a 4D mask (a name
with no mask function of its own would get no padding mask at all).

``attention_forward`` is transformers' flash-attention integration
(transformers/integrations/flash_attention.py, modeling_flash_attention_utils.py) on
ptxattn.torch's differentiable ops: the same signature, the same (batch, seqlen_q, heads,
head_dim) output, the same sliding-window convention, and the same three ways of packing a
batch: a 2D padding mask (unpadded into a varlen call and padded back), the
``cu_seq_lens_q/k`` and ``max_length_q/k`` keywords of ``DataCollatorWithFlattening``, or a
batch of one whose ``position_ids`` restart. What ptxattn cannot run raises a TypeError or
ValueError naming the model's feature (a 4D or float mask, attention dropout in training, a
head_dim ptxattn lacks, float32 attention outside autocast); nothing is routed to another
attention implementation.
"""

from typing import Optional

import torch
from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask
from transformers.modeling_utils import AttentionInterface

from . import dispatch
from . import torch as ptxattn_torch

__all__ = ["attention_forward", "register"]

_SIXTEEN_BIT = (torch.float16, torch.bfloat16)


def __dir__():
    return sorted(__all__)


def register() -> None:
    """Register ptxattn with transformers as ``attn_implementation="ptxattn"``.

    Puts :func:`attention_forward` into ``AttentionInterface`` and transformers'
    flash-attention mask function (a 2D padding mask or None) into ``AttentionMaskInterface``,
    both under "ptxattn", library-wide. Importing ``ptxattn.transformers`` calls it; calling it
    again changes nothing.

    Returns
    -------
    None
        The names go into transformers' class-wide mappings.

    Examples
    --------
    >>> import ptxattn.transformers
    >>> ptxattn.transformers.register()   # done on import; a second call is harmless
    >>> model = AutoModelForCausalLM.from_config(config, attn_implementation="ptxattn")
    """
    AttentionInterface.register("ptxattn", attention_forward)
    AttentionMaskInterface.register("ptxattn", flash_attention_mask)


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                      value: torch.Tensor, attention_mask: Optional[torch.Tensor],
                      dropout: float = 0.0, scaling: Optional[float] = None,
                      sliding_window: Optional[int] = None, softcap: Optional[float] = None,
                      is_causal: Optional[bool] = None, s_aux: Optional[torch.Tensor] = None,
                      **kwargs) -> tuple[torch.Tensor, None]:
    """A transformers attention layer's attention on ptxattn, differentiable.

    The function transformers calls for ``attn_implementation="ptxattn"``, with the signature of
    its flash-attention integration. Causal attention is bottom-right aligned, so a decode step
    of one query against a longer KV cache is a causal call. A padding mask turns the call into
    ``ptxattn.torch.attention_varlen`` over the unpadded tokens, the output padded back with
    zeros; so do packed sequences. Attention weights are never returned.

    Of the keywords the layer passes on, it reads ``position_ids`` (a batch of one whose
    positions restart is packed sequences), ``cu_seq_lens_q``, ``cu_seq_lens_k``,
    ``max_length_q`` and ``max_length_k`` (packed sequences, all four or none), and
    ``deterministic`` (bit-identical gradients from run to run; by default
    ``torch.are_deterministic_algorithms_enabled()``); it ignores the others
    (``output_attentions``, ``cache_position``, ...). A padding mask takes precedence over
    both kinds of packing, as in transformers' flash integration.

    Parameters
    ----------
    module : torch.nn.Module
        The attention layer: ``module.is_causal`` when ``is_causal`` is None.
    query : torch.Tensor
        (batch, heads_q, seqlen_q, head_dim), float16 or bfloat16 (float32 only under
        ``torch.autocast``, cast to its dtype), on a CUDA device; head_dim a multiple of 8 from
        8 to 256.
    key : torch.Tensor
        (batch, heads_kv, seqlen_k, head_dim), heads_q a multiple of heads_kv (GQA).
    value : torch.Tensor
        Like key but for its head_dim, which may be below the query's (multi-head latent
        attention): ptxattn runs it as it is, or, when it is no multiple of 8, padded with
        zeros up to one and cropped from the output.
    attention_mask : torch.Tensor, optional
        A 2D bool or integer (batch, seqlen_k) padding mask, 1 for a token (left or right
        padding), or None.
    dropout : float, default 0.0
        Must be 0: ptxattn has no attention dropout.
    scaling : float, optional
        The scale of the scores; 1 / sqrt(head_dim) by default.
    sliding_window : int, optional
        The layer's window: with more keys than it, a query sees its own key and the
        ``sliding_window - 1`` before it (and as many after it when not causal).
    softcap : float, optional
        Gemma-2's logit softcap: the scaled scores s become softcap * tanh(s / softcap).
    is_causal : bool, optional
        Causal (decoder) or not (encoder, cross-attention); ``module.is_causal`` by default.
    s_aux : torch.Tensor, optional
        gpt-oss's attention sinks, (heads_q,): a logit per head joining every row's softmax
        denominator, cast to float32; their gradient flows back.

    Returns
    -------
    attn_output : torch.Tensor
        (batch, seqlen_q, heads_q, value's head_dim) in the attention's dtype.
    attn_weights : None
        Always None.

    Raises
    ------
    TypeError
        float32 inputs outside autocast (or inputs of another dtype); a mask that is not a
        tensor, or a float mask.
    ValueError
        A 4D (or other non-2D) mask; dropout > 0; a head_dim ptxattn does not run (not a
        multiple of 8, over 256, or a value head_dim over the query's); packed
        ``position_ids`` with keys of another length; then ptxattn.torch's own errors.

    Examples
    --------
    >>> import ptxattn.transformers
    >>> model = AutoModelForCausalLM.from_config(config, attn_implementation="ptxattn",
    ...                                          dtype=torch.bfloat16).cuda()
    >>> model(input_ids, attention_mask=attention_mask).logits.float().mean().backward()
    >>> model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=16)
    """
    layer = type(module).__name__
    _check_mask(attention_mask, layer)
    if dropout > 0:
        raise ValueError(
            f"{layer} asks for attention dropout {dropout} (the model is in training mode and "
            f"its config sets an attention dropout): ptxattn has none; set the config's "
            f"attention dropout to 0.0, or use model.eval()")
    query, key, value = _sixteen_bit(query, key, value, layer)
    value_head_dim = value.shape[-1]
    value = _checked_value(query, value, layer)
    if is_causal is None:
        is_causal = module.is_causal
    deterministic = kwargs.get("deterministic")
    # ptxattn takes (batch, seqlen, heads, head_dim): the transpose undoes the layer's own.
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    options = dict(
        causal=is_causal, softmax_scale=scaling, softcap=softcap or 0.0,
        window=_window(sliding_window, is_causal, k.shape[1]),
        sinks=None if s_aux is None else s_aux.float(),
        deterministic=(torch.are_deterministic_algorithms_enabled() if deterministic is None
                       else deterministic))

    packed = (kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k"),
              kwargs.get("max_length_q"), kwargs.get("max_length_k"))
    if attention_mask is not None:
        out = _attend_padded(q, k, v, attention_mask.bool(), options)
    elif all(x is not None for x in packed):
        cu_q, cu_k, max_q, max_k = packed
        out = _attend_packed(q, k, v, cu_q, cu_k, max_q, max_k, options)
    elif (starts := _packed_sequence_starts(kwargs.get("position_ids"), q)) is not None:
        if k.shape[1] != q.shape[1]:
            raise ValueError(
                f"{layer} got packed sequences (position_ids restarting) with {q.shape[1]} "
                f"queries but {k.shape[1]} keys (a KV cache or cross-attention): packing by "
                f"position_ids needs the keys of the same tokens")
        cu_seqlens = torch.cat([starts, starts.new_tensor([q.shape[1]])])
        longest = cu_seqlens.diff().max()
        out = _attend_packed(q, k, v, cu_seqlens, cu_seqlens, longest, longest, options)
    else:
        out = ptxattn_torch.attention(q, k, v, **options)
    return out[..., :value_head_dim], None


def _check_mask(attention_mask, layer: str) -> None:
    """A TypeError or ValueError unless ``attention_mask`` is None or a 2D bool or integer
    padding mask, the one mask ptxattn can run without materializing it."""
    if attention_mask is None:
        return
    if not isinstance(attention_mask, torch.Tensor):
        raise TypeError(
            f"{layer} got an attention mask of type {type(attention_mask).__name__}: ptxattn "
            f"takes a 2D (batch, seqlen) padding mask or None")
    if attention_mask.dim() != 2:
        raise ValueError(
            f"{layer} got a {attention_mask.dim()}D attention mask of shape "
            f"{tuple(attention_mask.shape)} (a custom mask passed to the model, or one built "
            f"for another attn_implementation): ptxattn runs causal, sliding-window and "
            f"padding masks only, from a 2D (batch, seqlen) padding mask or None")
    if attention_mask.is_floating_point():
        # An additive float mask (0 to keep, -inf to drop) would read as its inverse.
        raise TypeError(
            f"{layer} got a {attention_mask.dtype} padding mask: ptxattn takes a bool or "
            f"integer mask, 1 (True) for a token, 0 for padding")


def _checked_value(query: torch.Tensor, value: torch.Tensor, layer: str) -> torch.Tensor:
    """value as the kernels take it: as it is when its head_dim is a multiple of 8 (16-bit
    values in whole 16-byte rows), otherwise padded with zeros up to the next one, which the
    caller crops from the output. A ValueError naming the layer's head dims and ptxattn's rule
    unless ptxattn runs them."""
    input_format = str(query.dtype).removeprefix("torch.")
    head_dim, value_head_dim = query.shape[-1], value.shape[-1]
    step = dispatch.head_dim_step(input_format)
    padded_dim = -(-value_head_dim // step) * step
    try:
        dispatch.check_head_dims(input_format, head_dim, padded_dim)
    except ValueError:
        rule = dispatch.head_dim_rule(input_format, max(dispatch.head_dims(input_format)))
        raise ValueError(
            f"{layer} has head_dim {head_dim} (value head_dim {value_head_dim}): ptxattn runs "
            f"head_dim {rule}, a value head_dim at most the query's") from None
    if padded_dim == value_head_dim:
        return value
    return torch.nn.functional.pad(value, (0, padded_dim - value_head_dim))


def _sixteen_bit(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 layer: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """query, key and value in one 16-bit dtype: as they are, or, under torch.autocast with a
    16-bit dtype, cast to it (autocast leaves the rotary embedding's products in float32, and
    asked for 16-bit arithmetic); a TypeError otherwise."""
    dtypes = {query.dtype, key.dtype, value.dtype}
    if len(dtypes) == 1 and dtypes <= set(_SIXTEEN_BIT):
        return query, key, value
    device = query.device.type
    if torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device) in _SIXTEEN_BIT:
        target = torch.get_autocast_dtype(device)
        return query.to(target), key.to(target), value.to(target)
    names = ", ".join(sorted(str(d).removeprefix("torch.") for d in dtypes))
    raise TypeError(
        f"{layer} gives ptxattn {names} query, key and value: ptxattn runs float16 and "
        f"bfloat16 attention; load the model with dtype=torch.bfloat16 (or float16), or run "
        f"it under torch.autocast")


def _window(sliding_window: Optional[int], is_causal: bool, seqlen_k: int) -> tuple[int, int]:
    """ptxattn's (left, right) window for transformers' ``sliding_window``, as transformers
    gives flash attention: (sliding_window - 1, sliding_window - 1) when there are more keys
    than the window (otherwise it masks nothing, and no window keeps the call off the serving
    builds), the right side 0 when causal, as flash attention makes it."""
    if sliding_window is None or seqlen_k <= sliding_window:
        return (-1, -1)
    return (sliding_window - 1, 0 if is_causal else sliding_window - 1)


def _unpad_data(padding_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The tokens of a 2D (batch, seqlen) bool padding mask: their indices into the flattened
    (batch * seqlen) rows, the int32 (batch + 1,) cu_seqlens of each row's count, and the
    largest count (copied to the host: the varlen call takes an int)."""
    seqlens = padding_mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(padding_mask.flatten()).flatten()
    cu_seqlens = torch.nn.functional.pad(torch.cumsum(seqlens, 0, dtype=torch.int32), (1, 0))
    return indices, cu_seqlens, int(seqlens.max())


def _rows(x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """The rows ``indices`` of x (batch, seqlen, heads, dim) flattened to (batch * seqlen)."""
    return x.reshape(-1, *x.shape[2:])[indices]


def _attend_padded(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   padding_mask: torch.Tensor, options: dict) -> torch.Tensor:
    """Attention under a 2D padding mask of the keys: a varlen call over the tokens, its output
    padded back with zeros into (batch, seqlen_q, heads, v's dim), as transformers does for flash
    attention (_upad_input), except that a non-causal call with a query length unlike the
    keys' is cross-attention, whose mask pads the keys alone: every query row is kept."""
    batch, seqlen_q = q.shape[:2]
    seqlen_k = padding_mask.shape[1]
    # A static cache holds rows beyond the mask, never written.
    k, v = k[:, :seqlen_k], v[:, :seqlen_k]
    indices_k, cu_seqlens_k, max_seqlen_k = _unpad_data(padding_mask)
    if seqlen_q == seqlen_k:
        indices_q, cu_seqlens_q, max_seqlen_q = indices_k, cu_seqlens_k, max_seqlen_k
    elif seqlen_q == 1 or not options["causal"]:
        # A decode step's one query a sequence, or cross-attention: every query row is a token.
        indices_q = None
        cu_seqlens_q = torch.arange(batch + 1, dtype=torch.int32, device=q.device) * seqlen_q
        max_seqlen_q = seqlen_q
    else:
        # Queries appended to a cache: the mask's last columns are theirs (left padding).
        indices_q, cu_seqlens_q, max_seqlen_q = _unpad_data(padding_mask[:, -seqlen_q:])
    q_tokens = q.reshape(-1, *q.shape[2:]) if indices_q is None else _rows(q, indices_q)
    # The cu_seqlens come from the mask, valid by construction: no check, no synchronization.
    out = ptxattn_torch.attention_varlen(q_tokens, _rows(k, indices_k), _rows(v, indices_k),
                                         cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                         check_contents=False, **options)
    shape = (*q.shape[:-1], v.shape[-1])
    if indices_q is None:
        return out.view(shape)
    padded = out.new_zeros(batch * seqlen_q, *out.shape[1:])
    return padded.index_copy(0, indices_q, out).view(shape)


def _attend_packed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q,
                   cu_seqlens_k, max_seqlen_q, max_seqlen_k, options: dict) -> torch.Tensor:
    """Attention over sequences packed into the flattened (batch * seqlen) rows, split by the
    caller's cu_seqlens (checked by ptxattn: they come from outside)."""
    out = ptxattn_torch.attention_varlen(
        q.reshape(-1, *q.shape[2:]), k.reshape(-1, *k.shape[2:]), v.reshape(-1, *v.shape[2:]),
        cu_seqlens_q.to(torch.int32), cu_seqlens_k.to(torch.int32), int(max_seqlen_q),
        int(max_seqlen_k), **options)
    return out.view(*q.shape[:-1], v.shape[-1])


def _packed_sequence_starts(position_ids: Optional[torch.Tensor],
                            q: torch.Tensor) -> Optional[torch.Tensor]:
    """Where each packed sequence starts in a batch of one, as transformers reads
    ``position_ids`` for flash attention (_is_packed_sequence, prepare_fa_kwargs_from_position_ids):
    at every position equal to the smallest; None when the batch is not one of packed
    sequences (larger than one, a single query, or positions counting up without restart)."""
    if position_ids is None or q.shape[0] != 1 or q.shape[1] == 1:
        return None
    positions = position_ids.reshape(-1)
    starts = torch.nonzero(positions == positions.min()).flatten().to(torch.int32)
    return starts if starts.numel() > 1 else None


register()
