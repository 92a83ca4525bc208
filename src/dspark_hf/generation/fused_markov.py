"""The greedy Markov loop of the fast path as one Triton kernel per drafted slot.

A greedy round drafts slot i as argmax(base_i + markov_w2(markov_w1[prev])), prev being the token drafted at slot
i - 1 (the anchor for slot 0): γ dependent steps. Compiled, the drafter's own loop runs 4 kernels a slot at the 50M
fixture's size (49,152 × 32) and 5 at a Qwen3 drafter's (151,936 × 256): the predecessor's code, the cuBLAS GEMV over
the vocabulary, the addition and the split argmax's stages. Where a round is some 200 short kernels (the fixture),
each launch costs about as much as its work. Here one kernel per slot gathers each row's predecessor code,
multiplies it with a tile of `markov_w2` (all rows of the batch at once, so the weight is read once per step, as
the GEMM reads it), adds the base logits and takes the tile's maximum; the tiles meet in a 64-bit `atomic_max` over
(order-preserving logit bits, inverted index), so the row's first maximal index wins, as in `torch.argmax`, and the
next slot's kernel reads its predecessor from there. The bias is rounded to the weight's dtype before the float32
addition, as `markov_w2(code).float()` rounds it. On an H100 (`benchmarks/fused_markov.py`,
benchmarks/results/fused_markov_h100.json) 7 slots took 29 µs against 60 at the fixture's size and batch 1, 220
against 277 µs at a Qwen3 drafter's, 335 against 598 µs at batch 64, with the same drafts in every case.

Only the vanilla Markov head is fused (every published DSpark checkpoint); gated and rnn heads, quantized weights
and tensors without Triton (CPU outside TRITON_INTERPRET=1) run `DSparkDraftModel.draft_tokens`, as every
greedy round does with `DSPARK_FUSED_MARKOV=0` in the environment (read when a round is traced). Greedy drafts
only: sampled rounds keep their processed logits and the race over them.
"""

from __future__ import annotations

import os

import torch

from ..models import DSparkDraftModel, TokenSelector, greedy_selector
from ..verify import triton_available

try:
    import triton
    import triton.language as tl
except ImportError:  # the kernel is optional: without Triton every call runs the drafter's own loop
    triton = None

__all__ = ["draft_tokens", "fused_markov_applies"]

BLOCK_V = 128  # vocabulary rows per program
NO_TOKEN = -(2**63)  # below every packed (logit, index) key
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"
SWITCH_VARIABLE = "DSPARK_FUSED_MARKOV"  # "0": greedy rounds run the drafter's own loop (to compare)


if triton is not None:

    @triton.jit
    def _markov_slot(
        base_ptr, w1_ptr, w2_ptr, anchor_ptr, best_ptr, slot, batch, vocab, num_slots,
        s_base_b, s_base_s, s_w1, s_w2,
        RANK: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK: tl.constexpr,
        FIRST: tl.constexpr, IEEE: tl.constexpr,
    ):
        """Slot `slot`'s logits over this program's vocabulary tile for BLOCK_B batch rows, and their maximum
        into best[row, slot] (packed key, atomically)."""
        rows = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
        row_ok = rows < batch
        if FIRST:
            prev = tl.load(anchor_ptr + rows, mask=row_ok, other=0)
        else:
            key = tl.load(best_ptr + rows * num_slots + slot - 1, mask=row_ok, other=0xFFFFFFFF)
            prev = 0xFFFFFFFF - (key & 0xFFFFFFFF)
        cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        col_ok = cols < vocab
        acc = tl.zeros([BLOCK_B, BLOCK], dtype=tl.float32)
        for start in range(0, RANK, BLOCK_R):
            ranks = start + tl.arange(0, BLOCK_R)
            rank_ok = ranks < RANK
            code = tl.load(w1_ptr + prev[:, None] * s_w1 + ranks[None, :], mask=row_ok[:, None] & rank_ok[None, :],
                           other=0.0)
            weight = tl.load(w2_ptr + cols[None, :] * s_w2 + ranks[:, None], mask=col_ok[None, :] & rank_ok[:, None],
                             other=0.0)
            if IEEE:  # float32 products, exact for 16-bit inputs
                acc = tl.dot(code.to(tl.float32), weight.to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(code, weight, acc)
        bias = acc.to(w2_ptr.dtype.element_ty).to(tl.float32)
        ok = row_ok[:, None] & col_ok[None, :]
        base = tl.load(base_ptr + rows[:, None] * s_base_b + slot * s_base_s + cols[None, :], mask=ok, other=0.0)
        logits = tl.where(ok, base + bias, float("-inf"))
        best = tl.max(logits, 1)
        index = tl.min(tl.where(logits == best[:, None], cols[None, :], vocab), 1)
        bits = (best + 0.0).to(tl.int32, bitcast=True)  # (+ 0.0: -0.0 and 0.0 tie, as in torch.argmax)
        ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # float order as signed integers
        packed = (ordered.to(tl.int64) << 32) | (0xFFFFFFFF - index.to(tl.int64))  # lower index wins a tie
        tl.atomic_max(best_ptr + rows * num_slots + slot, packed, mask=row_ok)


@torch.library.custom_op("dspark_hf::greedy_markov_drafts", mutates_args=())
def greedy_markov_drafts(base_logits: torch.Tensor, anchor: torch.Tensor, markov_w1: torch.Tensor,
                         markov_w2: torch.Tensor) -> torch.Tensor:
    """Greedy drafts [B, n] from base logits [B, n, V] (float32) after `anchor` [B], with the vanilla Markov
    weights `markov_w1` / `markov_w2` [V, r]; an opaque operator to torch.compile, as the attention kernel is."""
    batch, num_slots, vocab = base_logits.shape
    rank = markov_w1.shape[1]
    if base_logits.stride(-1) != 1:
        base_logits = base_logits.contiguous()
    best = torch.full((batch, num_slots), NO_TOKEN, dtype=torch.long, device=base_logits.device)
    block_b = max(16, min(64, triton.next_power_of_2(batch)))
    block_r = max(16, min(64, triton.next_power_of_2(rank)))
    grid = (triton.cdiv(vocab, BLOCK_V), triton.cdiv(batch, block_b))
    for slot in range(num_slots):
        _markov_slot[grid](
            base_logits, markov_w1, markov_w2, anchor, best, slot, batch, vocab, num_slots,
            base_logits.stride(0), base_logits.stride(1), markov_w1.stride(0), markov_w2.stride(0),
            RANK=rank, BLOCK_B=block_b, BLOCK_R=block_r, BLOCK=BLOCK_V, FIRST=slot == 0,
            IEEE=markov_w2.dtype == torch.float32 or INTERPRETED,  # (the interpreter's 16-bit dot is wrong)
        )
    return 0xFFFFFFFF - (best & 0xFFFFFFFF)


@greedy_markov_drafts.register_fake
def _(base_logits, anchor, markov_w1, markov_w2):
    return anchor.new_empty(base_logits.shape[0], base_logits.shape[1])


def fused_markov_applies(drafter: DSparkDraftModel, base_logits: torch.Tensor) -> bool:
    """Whether `draft_tokens` runs the kernel for `drafter`'s greedy drafts: a vanilla Markov head with plain float
    weights, and Triton for the logits' device."""
    head = drafter.markov_head
    if os.environ.get(SWITCH_VARIABLE, "1") == "0":
        return False
    if triton is None or head is None or head.head_type != "vanilla" or not triton_available(base_logits.device):
        return False
    w1, w2 = head.markov_w1.weight, head.markov_w2.weight
    return (w1.dtype == w2.dtype and w2.dtype in (torch.float32, torch.float16, torch.bfloat16)
            and w1.stride(1) == 1 and w2.stride(1) == 1 and type(head.markov_w2) is torch.nn.Linear
            and w1.device == w2.device == base_logits.device)


def draft_tokens(drafter: DSparkDraftModel, anchor: torch.LongTensor, hidden: torch.Tensor,
                 base_logits: torch.Tensor, select: TokenSelector = greedy_selector,
                 ) -> tuple[torch.LongTensor, torch.Tensor | None]:
    """`drafter.draft_tokens(anchor, hidden, base_logits, select)` as (tokens [B, n], their logits), where greedy
    drafts (`select` is `greedy_selector`) that `fused_markov_applies` to come from the kernel, without logits
    (None): the fast path's greedy rounds compare tokens only."""
    if select is greedy_selector and fused_markov_applies(drafter, base_logits):
        head = drafter.markov_head
        return greedy_markov_drafts(base_logits.float(), anchor, head.markov_w1.weight, head.markov_w2.weight), None
    proposal = drafter.draft_tokens(anchor, hidden, base_logits, select)
    return proposal.tokens, proposal.logits
