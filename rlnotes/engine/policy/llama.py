"""The Llama family's forward pass (Llama, Qwen2, Mistral) written as plain tensor operations, for the
training and reference passes and the prompt pass before sampling.

The model's own forward spends most of a small model's pass in Python around its matmuls: masks built
for every attention implementation, output records, kwargs checks, a module call per linear map and
peft's per-call adapter bookkeeping. Here, over the real (not padding) positions of [B, T] rows
gathered into one [N, H] matrix x (a few padding positions kept among them where gathering would
cost more than computing them: Slots), layer by layer,

    h = RMSNorm(x);  q, k, v = h Wq, h Wk, h Wv;  q, k = RoPE(q, p), RoPE(k, p)
    Q, K, V = q, k, v scattered into their [B, T] slots (0 at padding);  K, V = [K_cache; K], [V_cache; V]
    x = x + (softmax(Q K^T / sqrt(d) + M) V)[real] Wo
    x = x + (act(h' Wgate) * h' Wup) Wdown,  h' = RMSNorm(x)

and the last layer's output after the final RMSNorm, with W x = W0 x + s B A dropout(x) for a LoRA
layer whose adapter is on (W0 x with it off: the reference). M allows key column j for the query in
column i when j is a real column at or before i (the cache's columns first); a padding query keeps
its own column, so no softmax row is empty (its output is never read). The queries that share a key
and value head (grouped-query attention) are grouped by scaled_dot_product_attention, not repeated;
on a CPU under bf16 autocast it runs in float32 (attend).

Rows that share a prompt (LlamaLayers.tree) go as levels in one pass: a level's rows follow rows of
the level before (a prompt's G completions its prompt, the prompts a prefix they share), all levels'
real tokens in the one matrix x, and each level's queries attend to its ancestors' keys and values
then its own, as if those were in a KV cache.

The hidden states at real positions equal the model's own (`output_hidden_states`' last entry) up to
float32 rounding, and so do the gradients through them; positions of padding are 0. A module this
pass does not know how to compute as plain operations (another adapter type, a module with hooks) is
called as a module, so it computes what it computes in the model. Other architectures, sliding-window
attention, attention dropout while training and sharded (FSDP) weights go through the model's forward.
"""

from __future__ import annotations

import functools
from typing import Callable, List, NamedTuple, Optional, Sequence

import torch
import torch.nn.functional as F

from rlnotes.engine.hardware.fsdp import is_sharded
from rlnotes.engine.policy import padding
from rlnotes.engine.policy.merged import LowRankLinear, MergedLinear, add_update
from rlnotes.engine.policy.packed import PackedLinear, frozen_linear

# The causal LMs whose decoder layers compute exactly the layer above; their attention, MLP and norm
# classes are checked too, so a subclass that changes one of them is not taken for the family.
FAMILIES = ("Llama", "Qwen2", "Mistral")

Linear = Callable[[torch.Tensor], torch.Tensor]


def rms_norm(x: torch.Tensor, norm: torch.nn.Module) -> torch.Tensor:
    """w * x / sqrt(mean(x^2) + eps), in float32 and back to x's dtype before the weight, as the
    Llama family's RMSNorm."""
    if x.dtype == torch.float32:
        return x * torch.rsqrt(mean_square(x) + norm.variance_epsilon) * norm.weight
    h = x.float()
    return norm.weight * (h * torch.rsqrt(mean_square(h) + norm.variance_epsilon)).to(x.dtype)


def mean_square(x: torch.Tensor) -> torch.Tensor:
    """mean(x^2) over the last dimension [..., 1], as the sum over its size: the same numbers as
    .mean(), whose backward pass divides the whole [N, H] gradient by H where this divides [N, 1]
    (the norm's forward and backward passes over 1,500 x 576 floats 9.1 -> 7.9 ms, one thread of an
    AMX Xeon)."""
    return x.pow(2).sum(-1, keepdim=True) / x.shape[-1]


def hooked(module: torch.nn.Module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks)


def _lora(layer, pack_frozen: bool) -> Optional[Linear]:
    """x -> the peft LoRA linear layer's output, W0 x + sum over its active adapters of s B A dropout(x)
    (W0 x with its adapters off), or None where it computes something else (a variant such as DoRA,
    a LoRA bias, a merged adapter, a base layer that is not a plain linear map)."""
    from peft.tuners.lora import Linear as LoraLinear

    if type(layer) is not LoraLinear or layer.merged or hooked(layer):
        return None
    base = linear(layer.base_layer, pack_frozen)
    if layer.disable_adapters:
        return base
    terms = []
    for a in (a for a in layer.active_adapters if a in layer.lora_A):
        parts = (layer.lora_A[a], layer.lora_B[a], layer.lora_dropout[a])
        if (a in layer.lora_variant or layer.lora_bias[a] or any(map(hooked, parts))
                or type(parts[2]) not in (torch.nn.Dropout, torch.nn.Identity)):
            return None
        p = parts[2].p if type(parts[2]) is torch.nn.Dropout and parts[2].training else 0.0
        terms.append((parts[0].weight, parts[1].weight, layer.scaling[a], p))

    def forward(x: torch.Tensor) -> torch.Tensor:
        y = base(x)
        for a, b, scale, p in terms:
            y = add_update(y, x, a, b, scale, p)  # in the adapter's float32, also under bf16 autocast
        return y
    return forward


def linear(module: torch.nn.Module, pack_frozen: bool = True) -> Linear:
    """x -> module(x), without the module call around it where the module is a plain linear map
    (nn.Linear, a merged, low-rank or packed layer for sampling, a plain peft LoRA layer) and has no
    hooks; else the module itself. `pack_frozen`: a large frozen nn.Linear (a LoRA layer's base too)
    multiplies through oneDNN with packed copies of its weight kept between passes (frozen_linear)."""
    if hooked(module):
        return module
    if type(module) in (torch.nn.Linear, MergedLinear):
        return (pack_frozen and frozen_linear(module)) or functools.partial(F.linear, weight=module.weight,
                                                                           bias=module.bias)
    if type(module) in (PackedLinear, LowRankLinear):
        return module.forward
    return _lora(module, pack_frozen) or module


def family(model) -> Optional[str]:
    """The family of FAMILIES whose classes make up `model` (a causal LM), or None."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None or not len(layers):
        return None
    for name in FAMILIES:
        def named(module, part):
            return type(module).__name__ == f"{name}{part}"

        if named(model, "ForCausalLM") and named(model.model.norm, "RMSNorm") and all(
                named(layer, "DecoderLayer") and named(layer.self_attn, "Attention") and named(layer.mlp, "MLP")
                and named(layer.input_layernorm, "RMSNorm") and named(layer.post_attention_layernorm, "RMSNorm")
                for layer in layers):
            return name
    return None


def computed_family(model) -> Optional[torch.nn.Module]:
    """The causal LM inside `model` (itself, or the base model of a peft model) when its layers are
    those of FAMILIES with full attention and whole weights, else None (sliding windows, FSDP shards)."""
    if is_sharded(model):
        return None
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    found = family(inner)
    if found is None:
        return None
    windows = [getattr(layer.self_attn, "sliding_window", None) for layer in inner.model.layers]
    if found == "Mistral":  # its window is the config's, for every layer
        windows.append(getattr(inner.config, "sliding_window", None))
    return None if any(w is not None for w in windows) else inner


def rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """RoPE: x cos + rotate_half(x) sin, with rotate_half(x) sin = roll(x, d/2) (sign * sin) and
    sign = (-1 on the first half, +1 on the second)."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), signed_sin)


def half_sign(head_dim: int, like: torch.Tensor) -> torch.Tensor:
    """The sign that turns rotate_half into a roll: -1 on the first half of a head, +1 on the second."""
    half = head_dim // 2
    return torch.cat([-torch.ones(half), torch.ones(half)]).to(device=like.device, dtype=like.dtype)


def attention_mask(mask: torch.Tensor, length: int) -> torch.Tensor:
    """The keys each query may attend to, [B, 1, T, K] (True: attend), for the last `length` of the K
    columns of `mask` [B, K] (1 = a real column): a real column at or before the query's own, and the
    query's own column always (a padding query's only one)."""
    width = mask.shape[1]
    columns = torch.arange(width, device=mask.device)
    own = torch.arange(width - length, width, device=mask.device)[:, None]  # [T, 1]: each query's column
    allowed = (columns <= own) & mask.bool()[:, None]                       # [B, T, K]
    return (allowed | (columns == own))[:, None]


def attention_bias(allowed: torch.Tensor) -> torch.Tensor:
    """M as scaled_dot_product_attention adds it to the scores: 0 where `allowed` (attention_mask, or
    any 0/1 mask) lets a query see a key, -inf elsewhere, in float32: its log (log 1 = 0, log 0 = -inf),
    one operation. Made once a pass (a level), where a boolean mask is turned into it again at every
    call, a layer's."""
    return allowed.log()


def cpu_autocast(x: torch.Tensor) -> bool:
    """Whether `x` is on a CPU under autocast, where the attention computes in float32 (attend)."""
    return x.device.type == "cpu" and torch.is_autocast_enabled("cpu")


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, scale: float,
           gqa: bool) -> torch.Tensor:
    """softmax(q k^T scale + M) v by scaled_dot_product_attention, M = `bias` (attention_bias); on a
    CPU in float32 outside autocast, whose bf16 would round q, k and v for no gain: the CPU's flash
    attention ran its backward pass 6x slower in bf16 than in float32 (3.0 against 0.48 ms a layer,
    SmolLM2's DPO step on an AMX Xeon), and the attention's products are a few percent of a pass's
    FLOPs."""
    if cpu_autocast(q):
        with torch.autocast("cpu", enabled=False):
            return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=bias, scale=scale,
                                                  enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias.to(q.dtype), scale=scale, enable_gqa=gqa)


class LlamaLayers:
    """A model's modules as the functions of the pass above, as they are now (built per pass: sampling
    swaps layers in and out, and training flags decide dropout); `hidden` runs the pass."""

    def __init__(self, model, pack_frozen: bool = True):
        base, config = model.model, model.config
        make = functools.partial(linear, pack_frozen=pack_frozen)
        self.embed, self.rotary, self.norm = base.embed_tokens, base.rotary_emb, base.norm
        attn = base.layers[0].self_attn
        self.heads, self.kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, attn.head_dim
        self.scale = attn.scaling
        self.layers = [(layer.input_layernorm, *(make(getattr(layer.self_attn, f"{w}_proj")) for w in "qkvo"),
                        layer.post_attention_layernorm,
                        *(make(getattr(layer.mlp, f"{w}_proj")) for w in ("gate", "up", "down")), layer.mlp.act_fn)
                       for layer in base.layers]
        size = config.hidden_size  # the entries of a layer's 7 weight matrices: q, k, v, o, gate, up, down
        self.layer_weights = (2 * (self.heads + self.kv_heads) * self.head_dim + 3 * config.intermediate_size) * size

    @classmethod
    def of(cls, model) -> Optional["LlamaLayers"]:
        """The LlamaLayers of `model` (a causal LM, or a peft model around one), or None where the pass
        above is not what its forward computes (computed_family; attention dropout while training)."""
        inner = computed_family(model)
        if inner is None:
            return None
        if any(layer.self_attn.training and layer.self_attn.attention_dropout for layer in inner.model.layers):
            return None
        return cls(inner)

    def gathers(self, padding_positions: int) -> bool:
        """Whether a pass gathers its real positions out of this much padding (Slots), by the rule of
        padding.skip_padding: a gather and a scatter cost tens of microseconds whatever they save; a
        small model computes a few padding positions faster."""
        return padding.worth_gathering(padding_positions, self.layer_weights, 7)

    def _rotation(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sign * sin [N, 1, d] at the N tokens' `positions` [N], for rotate."""
        cos, sin = self.rotary(x[None], positions[None])                              # [1, N, d]
        return cos[0, :, None], (sin * half_sign(self.head_dim, sin))[0, :, None]

    def _layers(self, x: torch.Tensor, positions: torch.Tensor,
                attention: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """The layers above over the N tokens x [N, H] at `positions` [N], and the final norm; the
        position-wise maps on all N at once, `attention`(layer, q, k, v) ([N, heads, d] each, after
        RoPE) giving each token's attention output [N, heads * d] in the same order."""
        d = self.head_dim
        cos, sin = self._rotation(x, positions)
        for i, (norm1, wq, wk, wv, wo, norm2, gate, up, down, act) in enumerate(self.layers):
            h = rms_norm(x, norm1)
            q, k, v = (w(h).view(len(h), -1, d) for w in (wq, wk, wv))               # [N, heads, d]
            x = x + wo(attention(i, rotate(q, cos, sin), rotate(k, cos, sin), v))
            h = rms_norm(x, norm2)
            x = x + down(act(gate(h)) * up(h))
        return rms_norm(x, self.norm)

    def hidden(self, input_ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor,
               cache=None) -> torch.Tensor:
        """The last layer's hidden states after the final norm [B, T, H] for the tokens `input_ids`
        [B, T] at `positions` [B, T], `mask` [B, K] covering the cache's columns then these (0 at the
        hidden states of padding positions); keys and values go into `cache` (a DynamicCache whose
        layers all keep whole rows) when given."""
        slots = Slots(mask[:, -input_ids.shape[1]:], self.gathers)
        bias = attention_bias(attention_mask(mask, input_ids.shape[1]))
        layers = cache.layers if cache is not None else [None] * len(self.layers)

        def attention(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            q, k, v = (slots.place(t) for t in (q, k, v))                              # [B, heads, T, d]
            if layers[i] is not None:  # the values cached in float32 too where the attention computes in it
                k, v = layers[i].update(k, v.float() if cpu_autocast(v) else v)
            return slots.take(self.attend(q, k, v, bias))

        x = self.embed(slots.take_rows(input_ids))                                    # [N, H]
        return slots.output(self._layers(x, slots.take_rows(positions), attention))

    def tree(self, levels: Sequence[Level]) -> List[torch.Tensor]:
        """The hidden states after the final norm [R, T, H] of each of `levels` (0 at padding): rows
        whose tokens follow a row of the level before (its `parent`), itself following one of the
        level before it, and so on: each token attends to its ancestors' real tokens and to its own
        row's up to itself, as if every row were forwarded after its ancestors' tokens with their
        keys and values in a cache. One pass over every level's real tokens: the position-wise maps
        read each weight once for all of them (a pass per level would read it once per level, at the
        lower rate of fewer rows), and each level's attention takes its ancestors' keys and values
        by index_select, so their gradients add up in the rows they came from."""
        slots = [Slots(level.mask, self.gathers) for level in levels]
        masks, biases = [], []  # each level's columns after its ancestors', and the keys its queries see
        for level in levels:
            full = level.mask if level.parent is None else torch.cat([masks[-1][level.parent], level.mask], dim=1)
            masks.append(full)
            biases.append(attention_bias(attention_mask(full, level.mask.shape[1])))
        sizes = [s.count for s in slots]

        def attention(i: int, *qkv: torch.Tensor) -> torch.Tensor:
            outs, keys, values = [], None, None
            for level, s, see, parts in zip(levels, slots, biases, zip(*(t.split(sizes) for t in qkv))):
                q, k, v = (s.place(t) for t in parts)                                  # [R, heads, T, d]
                if level.parent is not None:  # the ancestors' keys and values first
                    k = torch.cat([keys.index_select(0, level.parent), k], dim=2)
                    v = torch.cat([values.index_select(0, level.parent), v], dim=2)
                keys, values = k, v
                outs.append(s.take(self.attend(q, k, v, see)))
            return torch.cat(outs)

        ids = torch.cat([s.take_rows(level.ids) for s, level in zip(slots, levels)])
        positions = torch.cat([s.take_rows(level.positions) for s, level in zip(slots, levels)])
        hidden = self._layers(self.embed(ids), positions, attention)
        return [s.output(h) for s, h in zip(slots, hidden.split(sizes))]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return attend(q, k, v, bias, self.scale, self.heads > self.kv_heads)


class Level(NamedTuple):
    """Rows of tokens for LlamaLayers.tree: `ids`, `mask` (1 = real) and `positions` [R, T], and each
    row's `parent` [R], a row of the level before whose tokens (and its ancestors') come before its
    own, or None (the first level)."""
    ids: torch.Tensor
    mask: torch.Tensor
    positions: torch.Tensor
    parent: Optional[torch.Tensor] = None


class Slots:
    """The real positions of rows [R, T] (`mask`: 1 = real) as the N rows of one matrix: `take_rows`
    gathers them from [R, T, ...], `place_rows` scatters them back (0 at padding); `place` and
    `take` turn [N, heads, d] into the attention's [R, heads, T, d] and its output back into
    [N, heads * d]. Padding that `gathers` (its number of positions) says is not worth gathering out
    is kept among the N instead (all R T positions): computed like real positions, never attended to,
    and 0 in the output."""

    def __init__(self, mask: torch.Tensor, gathers: Callable[[int], bool]):
        self.rows, self.length = mask.shape
        real = mask.reshape(-1).bool()
        padding = real.numel() - int(real.sum())
        self.index = real.nonzero().squeeze(-1) if gathers(padding) else None
        self.zero = real[:, None] if padding and self.index is None else None  # the padding kept, set to 0 at the end
        self.count = real.numel() if self.index is None else len(self.index)

    def take_rows(self, t: torch.Tensor) -> torch.Tensor:
        t = t.reshape(self.rows * self.length, *t.shape[2:])
        return t if self.index is None else t.index_select(0, self.index)

    def place_rows(self, t: torch.Tensor) -> torch.Tensor:
        if self.index is not None:
            t = t.new_zeros(self.rows * self.length, *t.shape[1:]).index_copy(0, self.index, t)
        return t.view(self.rows, self.length, *t.shape[1:])

    def output(self, t: torch.Tensor) -> torch.Tensor:
        """place_rows of the pass's output [N, H]: 0 at every padding position, also a kept one."""
        return self.place_rows(t if self.zero is None else t * self.zero)

    def place(self, t: torch.Tensor) -> torch.Tensor:
        return self.place_rows(t).transpose(1, 2)

    def take(self, out: torch.Tensor) -> torch.Tensor:
        return self.take_rows(out.transpose(1, 2).reshape(self.rows, self.length, -1))
