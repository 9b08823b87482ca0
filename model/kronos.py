"""Kronos: the decoder-only predictor over (s1, s2) token pairs.

A trunk of causal transformer blocks predicts the next coarse token s1; a dependency layer (cross-attention from the
s1 embedding to the trunk's hidden states) then predicts the fine token s2 given that s1."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from model.config import KronosConfig
from model.errors import DataError
from model.hub import PretrainedMixin
from model.layers import (
    HierarchicalEmbedding,
    KVCache,
    MultiHeadCrossAttentionWithRoPE,
    RMSNorm,
    TemporalEmbedding,
    TransformerBlock,
)

DEP_LAYER_HEADS = 4  # the published dependency layer has 4 heads whatever n_heads is


class DependencyAwareLayer(nn.Module):
    """norm(hidden + cross_attn(query=sibling, key=hidden, value=hidden))."""

    def __init__(self, d_model: int, n_heads: int = DEP_LAYER_HEADS):
        super().__init__()
        self.cross_attn = MultiHeadCrossAttentionWithRoPE(d_model, n_heads)
        self.norm = RMSNorm(d_model)

    def forward(self, hidden_states: torch.Tensor, sibling_embed: torch.Tensor,
                key_padding_mask: torch.Tensor | None = None, causal: bool | None = None) -> torch.Tensor:
        """hidden (B, L, d), sibling (B, Lq, d) -> (B, L, d); a length-1 sibling broadcasts over L (inference)."""
        attn_out = self.cross_attn(sibling_embed, hidden_states, hidden_states, key_padding_mask, causal=causal)
        return self.norm(hidden_states + attn_out)

    def memory(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden (B, L, d) -> keys, values (B, 4, L, d/4) for `step` (computed once per position and cached)."""
        return self.cross_attn.project_kv(hidden_states, hidden_states)

    def step(self, hidden_last: torch.Tensor, sibling_embed: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             valid: torch.Tensor | None = None) -> torch.Tensor:
        """forward(hidden, sibling)[:, -1:] in eval mode, from k/v = memory(hidden): hidden_last (B, 1, d), sibling
        (B, 1, d), k/v (B, 4, L, d/4) -> (B, 1, d); valid (L,): the filled positions of a static cache."""
        return self.norm(hidden_last + self.cross_attn.attend_kv(sibling_embed, k, v, valid))


class DualHead(nn.Module):
    """Two vocab projections: proj_s1 on the trunk output, proj_s2 on the dependency layer output."""

    def __init__(self, s1_bits: int, s2_bits: int, d_model: int):
        super().__init__()
        self.vocab_s1, self.vocab_s2 = 2 ** s1_bits, 2 ** s2_bits
        self.proj_s1 = nn.Linear(d_model, self.vocab_s1)
        self.proj_s2 = nn.Linear(d_model, self.vocab_s2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Trunk output (B, T, d) -> s1 logits (B, T, 2^s1_bits)."""
        return self.proj_s1(x)

    def cond_forward(self, x2: torch.Tensor) -> torch.Tensor:
        """Dependency-layer output (B, T, d) -> s2 logits (B, T, 2^s2_bits)."""
        return self.proj_s2(x2)

    def compute_loss(self, s1_logits: torch.Tensor, s2_logits: torch.Tensor, s1_targets: torch.Tensor,
                     s2_targets: torch.Tensor,
                     padding_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """logits (B, T, V1) / (B, T, V2), targets (B, T) int64 -> float32 scalars (loss = the mean of the two
        cross-entropies over the real positions, ce_s1, ce_s2); padding_mask (B, T): True/1 = real, False/0 = pad."""
        if padding_mask is not None:
            valid = padding_mask.to(torch.bool)
            s1_logits, s2_logits = s1_logits[valid], s2_logits[valid]
            s1_targets, s2_targets = s1_targets[valid], s2_targets[valid]
        ce_s1 = F.cross_entropy(s1_logits.reshape(-1, self.vocab_s1).float(), s1_targets.reshape(-1))
        ce_s2 = F.cross_entropy(s2_logits.reshape(-1, self.vocab_s2).float(), s2_targets.reshape(-1))
        return (ce_s1 + ce_s2) / 2, ce_s1, ce_s2


class Kronos(nn.Module, PretrainedMixin):
    """The Kronos predictor (published constructor arguments and state-dict keys)."""

    config_class = KronosConfig  # checks config.json before from_pretrained allocates anything

    def __init__(self, s1_bits: int, s2_bits: int, n_layers: int, d_model: int, n_heads: int, ff_dim: int,
                 ffn_dropout_p: float, attn_dropout_p: float, resid_dropout_p: float, token_dropout_p: float,
                 learn_te: bool):
        super().__init__()
        self._record_config(locals())
        self.s1_bits, self.s2_bits = s1_bits, s2_bits
        self.s1_vocab_size, self.s2_vocab_size = 2 ** s1_bits, 2 ** s2_bits
        self.d_model, self.n_layers, self.n_heads = d_model, n_layers, n_heads
        self.dep_slot = n_layers  # the cache slot of the dependency layer's keys/values, after the trunk's

        self.embedding = HierarchicalEmbedding(s1_bits, s2_bits, d_model)
        self.time_emb = TemporalEmbedding(d_model, learn_te)
        self.token_drop = nn.Dropout(token_dropout_p)
        self.transformer = nn.ModuleList(
            TransformerBlock(d_model, n_heads, ff_dim, ffn_dropout_p, attn_dropout_p, resid_dropout_p)
            for _ in range(n_layers))
        self.norm = RMSNorm(d_model)
        self.dep_layer = DependencyAwareLayer(d_model)
        self.head = DualHead(s1_bits, s2_bits, d_model)
        self.apply(self._init_weights)

    def check_tokenizer(self, tokenizer: nn.Module, keys: str = "") -> None:
        """A DataError unless `tokenizer` makes this predictor's tokens (the same s1/s2 bits: else its ids index out
        of the vocabularies); `keys` names the settings that chose the pair."""
        if (tokenizer.s1_bits, tokenizer.s2_bits) != (self.s1_bits, self.s2_bits):
            raise DataError(f"{keys}{': ' if keys else ''}the tokenizer has s1/s2 bits {tokenizer.s1_bits}/"
                            f"{tokenizer.s2_bits} but the predictor expects {self.s1_bits}/{self.s2_bits}; use a "
                            "matching pair")

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        """Initialisation for training from scratch (xavier-normal Linear, N(0, d^-0.5) Embedding, RMSNorm ones)."""
        if isinstance(module, nn.Linear):
            nn.init.xavier_normal_(module.weight)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding) and module.weight.requires_grad:
            nn.init.normal_(module.weight, mean=0.0, std=module.embedding_dim ** -0.5)
        elif isinstance(module, RMSNorm):
            nn.init.ones_(module.weight)

    # ------------------------------------------------------------------ trunk
    def trunk(self, s1_ids: torch.Tensor, s2_ids: torch.Tensor, stamp: torch.Tensor | None = None,
              padding_mask: torch.Tensor | None = None, cache: KVCache | None = None,
              start_pos: int = 0) -> torch.Tensor:
        """Token ids (B, L) (+ stamps (B, L, 5)) -> normalised hidden states (B, L, d_model); with `cache`, the ids
        are positions start_pos..start_pos+L-1 appended after the cached ones."""
        x = self.embedding((s1_ids, s2_ids))
        if stamp is not None:
            x = x + self.time_emb(stamp)
        x = self.token_drop(x)
        for i, layer in enumerate(self.transformer):
            x = layer(x, padding_mask, cache, i, start_pos)
        return self.norm(x)

    def forward(self, s1_ids: torch.Tensor, s2_ids: torch.Tensor, stamp: torch.Tensor | None = None,
                padding_mask: torch.Tensor | None = None, use_teacher_forcing: bool = False,
                s1_targets: torch.Tensor | None = None,
                causal_dep: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Ids (B, T), stamps (B, T, 5), padding_mask (B, T) True = real -> logits of the next token pair at every
        position: (s1 (B, T, 2^s1_bits), s2 (B, T, 2^s2_bits)). use_teacher_forcing: condition s2 on `s1_targets`
        (B, T) (the true next s1), else on an s1 drawn from the model's own s1 distribution. causal_dep: True keeps
        the dependency layer causal in eval mode too (an honest validation loss); None follows the published rule
        (causal only in training mode)."""
        x = self.trunk(s1_ids, s2_ids, stamp, padding_mask)
        s1_logits = self.head(x)
        if use_teacher_forcing:
            if s1_targets is None:
                raise ValueError("use_teacher_forcing=True needs s1_targets")
            sibling_ids = s1_targets
        else:
            probs = F.softmax(s1_logits.detach().float(), dim=-1)
            sibling_ids = torch.multinomial(probs.view(-1, self.s1_vocab_size), 1).view(s1_ids.shape)
        x2 = self.dep_layer(x, self.embedding.emb_s1(sibling_ids), padding_mask, causal=causal_dep)
        return s1_logits, self.head.cond_forward(x2)

    def decode_s1(self, s1_ids: torch.Tensor, s2_ids: torch.Tensor, stamp: torch.Tensor | None = None,
                  padding_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The trunk on a whole window (the full-recompute generator): ids (B, T) -> (s1 logits (B, T, 2^s1_bits),
        context = hidden states (B, T, d_model))."""
        x = self.trunk(s1_ids, s2_ids, stamp, padding_mask)
        return self.head(x), x

    def decode_s2(self, context: torch.Tensor, s1_ids: torch.Tensor,
                  padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        """s2 logits (B, T, 2^s2_bits) given `context` (B, T, d_model) from `decode_s1` and the chosen s1 ids
        (B, Lq) (Lq = 1 at inference: it broadcasts over T); position -1 is the next token's."""
        x2 = self.dep_layer(context, self.embedding.emb_s1(s1_ids), padding_mask)
        return self.head.cond_forward(x2)

    # ------------------------------------------------------- cached decoding
    def new_cache(self, batch: int, max_len: int, device: torch.device | str,
                  dtype: torch.dtype = torch.float32) -> KVCache:
        """Empty cache for `batch` sequences of up to `max_len` tokens: slots 0..n_layers-1 for the trunk's
        self-attention, slot n_layers (`self.dep_slot`) for the dependency layer's memory."""
        trunk = [(self.n_heads, self.d_model // self.n_heads)] * self.n_layers
        dep = self.dep_layer.cross_attn
        return KVCache(batch, max_len, trunk + [(dep.n_heads, dep.head_dim)], device, dtype)

    def decode_s1_cached(self, s1_ids: torch.Tensor, s2_ids: torch.Tensor, stamp: torch.Tensor | None,
                         cache: KVCache, start_pos: int | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append tokens (B, L) at window positions start_pos.. to `cache` (trunk and dependency memory; a tensor
        start_pos (1,) appends one token in place, see `KVCache`) -> (s1 logits of the last position (B, V1), its
        hidden state (B, 1, d_model)), the same numbers as `decode_s1` on the whole window."""
        h = self.trunk(s1_ids, s2_ids, stamp, cache=cache, start_pos=start_pos)  # (B, L, d)
        k, v = self.dep_layer.memory(h)  # (B, 4, L, d/4) each
        cache.update(self.dep_slot, start_pos, k, v)
        h_last = h[:, -1:]
        return self.head(h_last)[:, -1], h_last

    def decode_s2_cached(self, h_last: torch.Tensor, s1_ids: torch.Tensor, cache: KVCache,
                         length: int | torch.Tensor) -> torch.Tensor:
        """h_last (B, 1, d), sampled s1 (B, 1), `length` cached positions (a tensor (1,): a static step, the whole
        buffer under a mask) -> s2 logits (B, V2), the numbers of `decode_s2(context, s1_ids)[:, -1]`."""
        static = isinstance(length, torch.Tensor)
        k, v = (cache.k[self.dep_slot], cache.v[self.dep_slot]) if static else cache.filled(self.dep_slot, length)
        x2 = self.dep_layer.step(h_last, self.embedding.emb_s1(s1_ids), k, v, cache.valid(length) if static else None)
        return self.head.cond_forward(x2)[:, -1]
