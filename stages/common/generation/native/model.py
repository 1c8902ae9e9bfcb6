"""The native engine's Llama-family forward: batched prefill and one decode step over a static KV cache.

Pure tensor code over `InferenceWeights` (fused QKV and gate/up) and a preallocated cache; it does
not sample, stop sequences or know about requests (that is `engine.py`). Arithmetic follows
transformers' Llama/Qwen2/Mistral op for op (RMSNorm in float32, rotate-half RoPE, SDPA with the
same scale), so fp32 logits agree with an HF forward to ~1e-6.

Tensor parallel (tensor_parallel.py): the same code over one rank's shard (spec = the rank's spec:
heads, KV heads and intermediate / k), plus the collectives: an all_reduce after the vocab-parallel
embedding and after each row-parallel o_proj and down_proj (2 L + 1 per forward), and an all_gather
of the vocab-parallel LM head's logits. With tp=None (one device) none of them is called.

Cache layout: k[l], v[l] [B_max, kv_heads, S_max, head_dim], one tensor per layer. Prompts are
left-padded to a common width S, so cache slot s of every row is "the s-th column of the padded batch"; slot S
+ t holds decode step t. Row b's real tokens start at slot pad[b] and have positions 0, 1, 2, ...
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from alignflow.kernels import decode_attention as cpu_decode_attention
from alignflow.kernels import decode_step
from alignflow.kernels.rms_norm import rms_norm as kernel_rms_norm
from alignflow.stages.common.generation.native.spec import LlamaFamilySpec
from alignflow.stages.common.generation.native.weights import InferenceWeights

if TYPE_CHECKING:
    from alignflow.stages.common.generation.native.tensor_parallel import TensorParallel


class KVCache:
    """Preallocated keys and values for max_batch_size rows of max_seq_len slots."""

    def __init__(self, spec: LlamaFamilySpec, max_batch_size: int, max_seq_len: int, dtype: torch.dtype,
                 device: torch.device | str):
        shape = (max_batch_size, spec.num_kv_heads, max_seq_len, spec.head_dim)
        # Zeroed, not empty: the static-shape (CUDA graph) step attends to every slot behind a mask,
        # and a masked NaN from uninitialised memory would still poison softmax(...) @ V.
        # One tensor per layer rather than one [L, ...] tensor: torch.compile writes a slice of a
        # per-layer input in place, but L slice writes into one input become a copy of the whole
        # cache every step, orders of magnitude slower than the step itself on a long cache.
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(spec.num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(spec.num_layers)]
        self.max_batch_size = max_batch_size
        self.max_seq_len = max_seq_len

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm: normalise in float32, cast back, then scale. x [..., H], weight [H]."""
    if x.dtype == torch.float32:
        # One call instead of eight: F.rms_norm gives bit-identical fp32 results to the sequence below
        # and pays the per-call cost once; on CPU, outside torch.compile, kernels/rms_norm.py's C++ kernel,
        # also one autograd node for training (its reasons there).
        return kernel_rms_norm(x, weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """The sin table apply_rope takes: transformers' [..., D] sin with its first half negated."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE. x [B, T, heads, D]; cos, sin_signed [B, T, 1, D] (sin_signed = signed_sin(sin)).

    transformers' rotate_half(x) * sin = cat(-x2, x1) * sin = roll(x, D/2) * cat(-sin1, sin2), exactly (a
    sign moved from x to the table is exact): one roll where rotate_half takes two slices, a negation and
    a cat (3 fewer operator calls per use, and per backward).
    """
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin_signed


def _as_bias(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Additive attention mask: 0 where allowed, -inf elsewhere (SDPA would convert a bool mask to
    this inside every call, i.e. once per layer per step)."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(
        ~allowed, float("-inf")
    )


def prefill_masks(
    spec: LlamaFamilySpec, pad: torch.Tensor, width: int, dtype: torch.dtype = torch.float32
) -> dict[int | None, torch.Tensor]:
    """Additive masks [B, 1, S, S] (0 = attend, -inf = not), one per distinct sliding window.

    Query slot i sees key slot j when j <= i, j is a real token (j >= pad), and i - j < window.
    A padding slot sees only itself: a row with nothing to attend to would give NaN, and NaN
    keys/values in padding slots would leak into real rows through 0 * NaN.
    """
    slots = torch.arange(width, device=pad.device)
    i, j = slots[:, None], slots[None, :]
    causal = (j <= i)[None]  # [1, S, S]
    real = j[None] >= pad[:, None, None]  # [B, 1, S]
    masks = {}
    for window in set(spec.sliding_windows):
        allowed = causal & real
        if window is not None:
            allowed = allowed & (i - j < window)[None]
        masks[window] = _as_bias((allowed | (i == j)[None]).unsqueeze(1), dtype)
    return masks


class DecodeMasks:
    """Decode-step additive attention masks of one generate call, cut per step with as few ops as possible.

    bias [B, S_max]: 0 where slot j holds a real token of row b (j >= pad[b]), else -inf. For a query
    in slot `slot`, full-attention layers use bias[:, :slot + 1] (a view: no work per step);
    sliding-window layers also drop keys with slot - j >= window.
    """

    def __init__(self, spec: LlamaFamilySpec, pad: torch.Tensor, max_seq_len: int, dtype: torch.dtype):
        self.slots = torch.arange(max_seq_len, device=pad.device)
        self.dtype = dtype
        self.bias = _as_bias(self.slots[None, :] >= pad[:, None], dtype)
        self.windows = sorted({w for w in spec.sliding_windows if w is not None})
        self.has_full = any(w is None for w in spec.sliding_windows)

    def at(self, slot: int, kv_len: int) -> dict[int | None, torch.Tensor]:
        """Masks {window: [B, 1, 1, kv_len]} for the query in cache slot `slot` (kv_len > slot)."""
        base = self.bias[:, :kv_len]
        if kv_len > slot + 1:  # static shapes: later slots are in the window of keys, mask them
            base = base.masked_fill(self.slots[:kv_len] > slot, float("-inf"))
        masks = {None: base[:, None, None, :]} if self.has_full else {}
        for window in self.windows:
            masks[window] = base.masked_fill(self.slots[:kv_len] <= slot - window, float("-inf"))[
                :, None, None, :
            ]
        return masks


def decode_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """Attention of the decode step as two batched matmuls and a float32 softmax.

    q [B, kv_heads, groups, D], keys/values [B, kv_heads, L, D], mask additive [B, 1, 1, L];
    returns [B, kv_heads, groups, D]. Decode attention is bound by reading the KV cache (B = 64,
    12 heads, 88 slots, bf16: 17 MB per layer); eagerly this and SDPA's CPU kernel cost about the same,
    but torch.compile fuses this form into one loop, faster than either, which SDPA, an opaque call to
    inductor, does not allow. Agrees with SDPA to ~1e-7 in fp32 (tests compare
    logits with transformers at 1e-4).
    """
    B, kv_heads, groups, D = q.shape
    L = keys.shape[2]
    # As 3-D bmm over (row, KV head): 4-D matmul adds an expand and a view per operand and result (12 vs 16
    # operator calls per layer); the sliced cache [B, kv, L, D] folds (B, kv) without a copy. The scores
    # are fresh, so scale and mask go in place: the same fp32 arithmetic, (s * scale) + mask.
    scores = torch.bmm(q.reshape(B * kv_heads, groups, D), keys.reshape(B * kv_heads, L, D).transpose(1, 2))
    scores = scores.view(B, kv_heads, groups, L).float().mul_(scale).add_(mask)
    probs = torch.softmax(scores, dim=-1).to(values.dtype).view(B * kv_heads, groups, L)
    return torch.bmm(probs, values.reshape(B * kv_heads, L, D)).view(B, kv_heads, groups, D)


class LlamaFamilyModel:
    """Forward passes of one Llama-family model over its inference weights and KV cache.

    spec: the shapes this process holds (the rank's shard under tensor parallelism: weights.local_spec).
    tp: the tensor-parallel group, or None on one device (no collectives at all).
    """

    def __init__(
        self,
        spec: LlamaFamilySpec,
        weights: InferenceWeights,
        cos: torch.Tensor,
        sin: torch.Tensor,
        linear: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.linear,
        cpu_attention: bool = False,
        tp: TensorParallel | None = None,
        decode_kernels: str = "torch",
        fused_ops: Iterable[str] = decode_step.FUSED_OPS,
    ):
        self.spec = spec
        self.tp = tp
        # The static (CUDA-graph) decode step's ops: "torch" (the eager ops below) or "triton", the fused
        # kernels of kernels/decode_step.py (engine.gpu_decode_kernels).
        self.decode_kernels = decode_kernels
        # Under "triton", each fused op's impl: "triton" for those in `fused_ops` (engine.gpu_fused_ops), else
        # its torch reference in the same step (one kernel set aside, or what each buys: decode_fusions.py).
        fused = set(fused_ops)
        if fused - set(decode_step.FUSED_OPS):
            raise ValueError(f"fused_ops: {sorted(fused - set(decode_step.FUSED_OPS))} are not fused ops "
                             f"(of {', '.join(decode_step.FUSED_OPS)})")
        self.fused_impl = {op: "triton" if op in fused else "torch" for op in decode_step.FUSED_OPS}
        # x @ w.T without bias: F.linear, or prepack.linear (packed weight copies on CPU).
        self.linear = linear
        # Decode attention through alignflow::decode_attention (kernels/decode_attention.py: fp32, AVX-512).
        self.cpu_attention = cpu_attention
        self.weights = weights
        self.cos = cos  # [S_max, D] in the model dtype, on the model device
        self.sin = signed_sin(sin)  # apply_rope's table
        self.scale = spec.head_dim**-0.5
        # A bool fixed here: under torch.compile(dynamic=True) the spec's ints are traced as symbols,
        # `heads > kv_heads` becomes a SymBool, SDPA's enable_gqa rejects it, and the resulting graph
        # break split the compiled decode step at every layer (24 compiled regions per step).
        self.gqa = spec.num_heads != spec.num_kv_heads

    @torch.no_grad()
    def forward(
        self,
        cache: KVCache,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        slot: int | torch.Tensor | None,
        masks: dict[int | None, torch.Tensor],
        *,
        logits_for: str = "last",
        pad: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run T new tokens per row through the model, writing their keys/values into cache slots.

        tokens, positions: [B, T] long. slot: first cache slot of the T tokens, an int (eager: keys
        up to slot + T are attended, the rest of the cache is not read) or a 1-element long tensor
        (static shapes for CUDA graphs: T must be 1 and all S_max slots are attended behind the
        mask), or None: slot = kv_len - T, read from the masks' shape (the compiled decode step: its
        only varying sizes are then tensor dims, which can be marked dynamic before the first compile,
        where an int argument would compile once as a constant and again as a symbol).
        masks: window -> additive [B, 1, T, kv_len] (0 / -inf). Returns float32 logits,
        [B, V] for logits_for="last", [B, T, V] for "all" (zeros at padding slots when `pad` is given).
        pad: [B] left-padding widths of a prefill (T > 1, slot 0). When given, the linears, norms and MLP
        run on the real tokens only (packed rows): prompts of mixed lengths do not pay for their padding
        (24-wide batch of 8-24-token prompts: 1037 real rows of 1536). Only attention and the cache write
        see the padded layout, where padding slots hold zero keys and values that every mask excludes.
        """
        spec, w = self.spec, self.weights
        B, T = tokens.shape
        q_size, kv_size, D = spec.q_size, spec.kv_size, spec.head_dim
        static = isinstance(slot, torch.Tensor)
        if static and T == 1 and self.decode_kernels == "triton":
            return self._fused_decode_step(cache, tokens, positions, slot, masks)
        if slot is None:
            slot = next(iter(masks.values())).shape[-1] - T
        kv_len = cache.max_seq_len if static else slot + T
        cos = self.cos[positions].unsqueeze(2)  # [B, T, 1, D]
        sin = self.sin[positions].unsqueeze(2)  # signed: see apply_rope
        qkv_b, o_b = w.get("qkv_b"), w.get("o_b")
        qkv_w, o_w, gate_up_w, down_w = w["qkv_w"], w["o_w"], w["gate_up_w"], w["down_w"]
        ln_attn, ln_mlp = w["ln_attn"], w["ln_mlp"]
        heads, kv_heads = spec.num_heads, spec.num_kv_heads
        groups = heads // kv_heads
        gqa = self.gqa
        eps = spec.rms_norm_eps
        linear = self.linear
        tp = self.tp

        real = None
        if pad is not None and T > 1 and bool((pad > 0).any()):
            # Flat indices (b * T + t) of the real tokens, in order: row b's last real token is slot T - 1.
            real = (
                (torch.arange(T, device=tokens.device)[None, :] >= pad[:, None])
                .reshape(-1)
                .nonzero()
                .squeeze(1)
            )
            x = self._embed(tokens.reshape(-1)[real])  # [N, H]
        else:
            x = self._embed(tokens)  # [B, T, H]
        # A decode step (T = 1) runs its linears, norms and MLP on [B, H]: a linear of a 3-D input is four
        # operator calls (view, t, mm, view) against two, 18 of the demo model's ~240 calls per step.
        flat = T == 1 and real is None
        if flat:
            x = x.view(B, x.shape[-1])
        for layer in range(spec.num_layers):
            h = rms_norm(x, ln_attn[layer], eps)
            qkv = linear(h, qkv_w[layer])  # [B, T, Q + 2K], or [N, Q + 2K] packed
            if qkv_b is not None:
                qkv = qkv + qkv_b[layer]
            if real is not None:  # into the padded layout for RoPE, the cache and attention
                qkv = qkv.new_zeros(B * T, qkv.shape[-1]).index_copy_(0, real, qkv).view(B, T, -1)
            # q and k heads are adjacent in the fused output: rotate them in one pass.
            qk = apply_rope(qkv[..., : q_size + kv_size].view(B, T, heads + kv_heads, D), cos, sin)
            q = qk[:, :, :heads].transpose(1, 2)  # [B, heads, T, D]
            k = qk[:, :, heads:].transpose(1, 2)  # [B, kv_heads, T, D]
            v = qkv[..., q_size + kv_size :].view(B, T, kv_heads, D).transpose(1, 2)
            k_cache, v_cache = cache.k[layer], cache.v[layer]
            if static:
                k_cache[:B].index_copy_(2, slot, k)
                v_cache[:B].index_copy_(2, slot, v)
            else:
                k_cache[:B, :, slot : slot + T] = k
                v_cache[:B, :, slot : slot + T] = v
            keys = k_cache[:B, :, :kv_len]  # [B, kv_heads, kv_len, D], a view: no copy
            values = v_cache[:B, :, :kv_len]
            mask = masks[spec.sliding_windows[layer]]
            if T == 1:
                # One query per row: fold the query heads of a KV group into the "time" axis, so each
                # cached key is read once with no repeat_kv copy.
                if self.cpu_attention and not static:
                    attn = cpu_decode_attention.op(
                        q.reshape(B, kv_heads, groups, D), keys, values, mask.reshape(B, kv_len), self.scale
                    )
                else:
                    attn = decode_attention(q.reshape(B, kv_heads, groups, D), keys, values, mask, self.scale)
                attn = attn.reshape(B, q_size) if flat else attn.reshape(B, 1, q_size)
            else:
                attn = (
                    F.scaled_dot_product_attention(
                        q, keys, values, attn_mask=mask, scale=self.scale, enable_gqa=gqa
                    )
                    .transpose(1, 2)
                    .reshape(B, T, q_size)
                )
                if real is not None:
                    attn = attn.reshape(B * T, q_size).index_select(0, real)
            out = linear(attn, o_w[layer])
            if tp is not None:  # row-parallel: sum the ranks' partial products, then the bias once
                out = tp.all_reduce(out)
            x = x + (out if o_b is None else out + o_b[layer])
            h = rms_norm(x, ln_mlp[layer], eps)
            gate, up = linear(h, gate_up_w[layer]).chunk(2, dim=-1)
            down = linear(F.silu(gate) * up, down_w[layer])
            x = x + (down if tp is None else tp.all_reduce(down))
        if real is not None and logits_for == "last":
            x = x.index_select(0, torch.cumsum(T - pad, 0) - 1)  # each row's last real token
        elif real is not None:
            x = x.new_zeros(B * T, x.shape[-1]).index_copy_(0, real, x).view(B, T, -1)
        elif flat and logits_for != "last":
            x = x.view(B, 1, x.shape[-1])
        elif logits_for == "last" and not flat:
            x = x[:, -1]
        x = rms_norm(x, w["norm"], eps)
        logits = linear(x, w["lm_head"])
        if tp is not None:  # this rank's vocab rows -> the full vocabulary on every rank
            logits = tp.gather_logits(logits)
        return logits.float()

    def _fused_decode_step(
        self,
        cache: KVCache,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        slot: torch.Tensor,
        masks: dict[int | None, torch.Tensor],
    ) -> torch.Tensor:
        """forward's static decode step (T = 1, slot a [1] tensor) on kernels/decode_step.py's fused ops.

        The same arithmetic as the eager step, layer for layer: RoPE and the cache write in one kernel,
        attention over slots 0..slot only (the eager step reads all S_max behind the mask), the residual add
        fused with the norm that follows it (the last layer's with the final norm), SiLU(gate) * up in one.
        The linears stay `self.linear` (cuBLAS on a GPU) and the collectives the tensor-parallel ones."""
        spec, w, tp = self.spec, self.weights, self.tp
        B = tokens.shape[0]
        heads, kv_heads, D = spec.num_heads, spec.num_kv_heads, spec.head_dim
        eps, linear, impl = spec.rms_norm_eps, self.linear, self.fused_impl
        qkv_b, o_b = w.get("qkv_b"), w.get("o_b")
        cos, sin = self.cos[positions[:, 0]], self.sin[positions[:, 0]]  # [B, D]
        x = self._embed(tokens[:, 0])  # [B, H]
        h = rms_norm(x, w["ln_attn"][0], eps)
        for layer in range(spec.num_layers):
            qkv = linear(h, w["qkv_w"][layer])
            if qkv_b is not None:
                qkv = qkv + qkv_b[layer]
            k_cache, v_cache = cache.k[layer][:B], cache.v[layer][:B]
            q = decode_step.rope_cache_write(
                qkv, cos, sin, k_cache, v_cache, slot, heads, kv_heads, impl=impl["rope_cache_write"]
            )
            mask = masks[spec.sliding_windows[layer]].view(B, -1)
            attn = decode_step.live_attention(
                q.view(B, kv_heads, heads // kv_heads, D), k_cache, v_cache, mask, slot, self.scale,
                impl=impl["live_attention"],
            )
            out = linear(attn.view(B, heads * D), w["o_w"][layer])
            if tp is not None:
                out = tp.all_reduce(out)
            if o_b is not None:
                out = out + o_b[layer]
            x, h = decode_step.add_rms_norm(x, out, w["ln_mlp"][layer], eps, impl=impl["add_rms_norm"])
            gate_up = linear(h, w["gate_up_w"][layer])
            down = linear(decode_step.silu_mul(gate_up, impl=impl["silu_mul"]), w["down_w"][layer])
            if tp is not None:
                down = tp.all_reduce(down)
            following = w["ln_attn"][layer + 1] if layer + 1 < spec.num_layers else w["norm"]
            x, h = decode_step.add_rms_norm(x, down, following, eps, impl=impl["add_rms_norm"])
        logits = linear(h, w["lm_head"])
        if tp is not None:
            logits = tp.gather_logits(logits)
        return logits.float()

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Embedding rows of token ids [...] -> [..., H] (vocab-parallel under tensor parallelism)."""
        if self.tp is None:
            return F.embedding(ids, self.weights["embed"])
        return self.tp.embed(ids, self.weights["embed"])
