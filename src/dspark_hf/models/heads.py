"""The DSpark heads: the low-rank Markov head (sequential stage) and the confidence head.

Parameter names follow DeepSpec (`markov_head.markov_w1`, `markov_head.markov_w2`, `confidence_head.proj`), so
published checkpoints load unchanged. Slot i's predecessor `prev_i` is the anchor for i = 0 and the token drafted
at slot i-1 otherwise (teacher-forced ground truth in training).
"""

from __future__ import annotations

import torch
from torch import nn

from .configuration import DSparkConfig


class MarkovHead(nn.Module):
    """Adds a bias `markov_w2(u)` to slot logits, where u is a rank-r code of the previous token.

    `vanilla`: u = w1[prev]. `gated`: u = σ(gate_proj([h; w1[prev]])) ⊙ w1[prev].
    `rnn`: a gated recurrent state over the block, `[g, c, o] = joint_proj([s; w1[prev]; h])`,
    s' = σ(g)·s + (1-σ(g))·tanh(c), u = tanh(o).
    """

    def __init__(self, config: DSparkConfig):
        super().__init__()
        rank, hidden, vocab = config.markov_rank, config.hidden_size, config.vocab_size
        self.head_type = config.markov_head_type
        self.rank = rank
        self.markov_w1 = nn.Embedding(vocab, rank)
        self.markov_w2 = nn.Linear(rank, vocab, bias=False)
        if self.head_type == "gated":
            self.gate_proj = nn.Linear(hidden + rank, rank)
        elif self.head_type == "rnn":
            self.joint_proj = nn.Linear(2 * rank + hidden, 3 * rank)

    def initial_state(self, batch_size: int, reference: torch.Tensor) -> torch.Tensor | None:
        """Recurrent state before slot 0 (zeros for `rnn`, None otherwise)."""
        if self.head_type != "rnn":
            return None
        return reference.new_zeros(batch_size, self.rank)

    def step(
        self, prev_ids: torch.LongTensor, hidden: torch.Tensor, state: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One slot: `prev_ids` [B], `hidden` [B, H] -> (logit bias [B, V], new state)."""
        code = self.markov_w1(prev_ids)
        if self.head_type == "gated":
            code = torch.sigmoid(self.gate_proj(torch.cat([hidden, code], dim=-1))) * code
        elif self.head_type == "rnn":
            gate, candidate, out = self.joint_proj(torch.cat([state, code, hidden], dim=-1)).chunk(3, dim=-1)
            gate = torch.sigmoid(gate)
            state = gate * state + (1 - gate) * torch.tanh(candidate)
            code = torch.tanh(out)
        return self.markov_w2(code), state

    def block_bias(self, prev_ids: torch.LongTensor, hidden: torch.Tensor) -> torch.Tensor:
        """All slots of teacher-forced blocks at once: `prev_ids` [..., γ], `hidden` [..., γ, H] -> [..., γ, V]."""
        if self.head_type != "rnn":
            code = self.markov_w1(prev_ids)
            if self.head_type == "gated":
                code = torch.sigmoid(self.gate_proj(torch.cat([hidden, code], dim=-1))) * code
            return self.markov_w2(code)
        lead = prev_ids.shape[:-1]
        flat_prev = prev_ids.reshape(-1, prev_ids.shape[-1])
        flat_hidden = hidden.reshape(-1, *hidden.shape[-2:])
        state = self.initial_state(flat_prev.shape[0], flat_hidden)
        biases = []
        for slot in range(flat_prev.shape[1]):
            bias, state = self.step(flat_prev[:, slot], flat_hidden[:, slot], state)
            biases.append(bias)
        return torch.stack(biases, dim=1).reshape(*lead, prev_ids.shape[-1], -1)


class ConfidenceHead(nn.Module):
    """`proj([h_i; markov_w1[prev_i]])` -> logit of c_i, the probability that draft i survives given i-1 did."""

    def __init__(self, config: DSparkConfig):
        super().__init__()
        self.proj = nn.Linear(config.confidence_input_size, 1)

    def forward(self, hidden: torch.Tensor, markov_code: torch.Tensor | None) -> torch.Tensor:
        features = hidden if markov_code is None else torch.cat([hidden, markov_code], dim=-1)
        return self.proj(features).squeeze(-1)
