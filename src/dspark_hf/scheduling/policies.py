"""Verify-length policies: per request r, how many drafted tokens l_r (0 <= l_r <= gamma) go to verification.

All policies take ``conf`` [R, gamma], the (calibrated) *conditional* acceptance probabilities
c_{r,k} = P(draft k accepted | drafts < k accepted), and return a LongTensor [R]. ``max_lengths`` [R]
caps l_r by the number of drafts actually available for request r. Values of ``conf`` are clamped to
[0, 1]. Every policy is *non-anticipating*: whether draft k of request r is verified depends only on
c_{r,1..k} (which may depend on the sampled x_{r,<k}, never on x_{r,k}) and on other requests, so the
rejection-sampling output stays exactly the target's distribution (see docs/scheduling.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch

__all__ = [
    "SPSLike",
    "SchedulerPolicy",
    "fixed_length",
    "static_threshold",
    "hardware_aware_sync",
    "hardware_aware_async",
    "async_capacity",
    "top_k_prefix",
    "get_policy",
    "POLICY_NAMES",
]


class SPSLike(Protocol):
    """Anything mapping a tensor of total batch tokens B to steps/s (e.g. :class:`SPSTable`)."""

    def __call__(self, batch_tokens: torch.Tensor) -> torch.Tensor: ...


# ---------------------------------------------------------------------------- helpers
def _check(conf: torch.Tensor, max_lengths: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    if conf.dim() != 2:
        raise ValueError(f"conf must be [R, gamma], got shape {tuple(conf.shape)}.")
    r, g = conf.shape
    if max_lengths is None:
        cap = torch.full((r,), g, dtype=torch.long, device=conf.device)
    else:
        cap = torch.as_tensor(max_lengths, device=conf.device).long()
        if cap.shape != (r,):
            raise ValueError(f"max_lengths must be [R]={r}, got shape {tuple(cap.shape)}.")
        cap = cap.clamp(0, g)
    return conf, cap


def _sorted_candidates(
    conf: torch.Tensor, cap: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Candidates (r, k) with a_{r,k} > 0 and k <= cap_r, sorted by a descending, ties by smaller k, then r.

    Returns (sorted survival values [E], their request ids [E], E). Because a_{r,k} is non-increasing in k
    and ties go to smaller k, every prefix of this order is prefix-consistent per request.
    """
    r, g = conf.shape
    a = conf.to(torch.float64).clamp(0.0, 1.0).cumprod(dim=-1)  # [R, g]
    slot = torch.arange(g, device=conf.device)
    valid = (slot[None, :] < cap[:, None]) & (a > 0)
    # k-major flattening: flat index = k * R + r, so a stable sort breaks ties by k, then r.
    a_t = a.t().reshape(-1)
    v_t = valid.t().reshape(-1)
    key = torch.where(v_t, -a_t, torch.full_like(a_t, float("inf")))
    order = torch.sort(key, stable=True).indices
    e = int(v_t.sum())
    order = order[:e]
    return a_t[order], order % r, e


def _lengths_from_top(req_ids: torch.Tensor, n: int, r: int) -> torch.Tensor:
    out = torch.zeros(r, dtype=torch.long, device=req_ids.device)
    if n > 0:
        out.scatter_add_(0, req_ids[:n], torch.ones(n, dtype=torch.long, device=req_ids.device))
    return out


def _throughput_path(surv: torch.Tensor, r: int, sps: SPSLike) -> torch.Tensor:
    """Theta_i = tau_i * SPS(B_i) after admitting the first i sorted candidates, i = 0..E (float64 [E+1])."""
    zero = torch.zeros(1, dtype=torch.float64, device=surv.device)
    tau = r + torch.cat([zero, surv.cumsum(0)])
    b = r + torch.arange(surv.numel() + 1, dtype=torch.float64, device=surv.device)
    return tau * torch.as_tensor(sps(b), dtype=torch.float64, device=surv.device)


# ---------------------------------------------------------------------------- policies
def fixed_length(conf: torch.Tensor, gamma: int, max_lengths: torch.Tensor | None = None) -> torch.Tensor:
    """Verify min(gamma, available drafts) tokens for every request (``conf`` only gives the shape)."""
    conf, cap = _check(conf, max_lengths)
    if gamma < 0:
        raise ValueError(f"gamma must be >= 0, got {gamma}.")
    return cap.clamp(max=int(gamma))


def static_threshold(
    conf: torch.Tensor, threshold: float, max_lengths: torch.Tensor | None = None
) -> torch.Tensor:
    """DeepSpec's evaluator rule: the first slot whose conditional confidence is < threshold ends the prefix."""
    conf, cap = _check(conf, max_lengths)
    keep = (conf >= threshold).long().cumprod(dim=-1).sum(dim=-1)
    return torch.minimum(keep, cap)


def hardware_aware_sync(
    conf: torch.Tensor, sps_table: SPSLike, max_lengths: torch.Tensor | None = None
) -> torch.Tensor:
    """Algorithm 1 (paper §3.2.2): greedy admission by cumulative survival, stop at the FIRST fall of Theta.

    Candidates (r, k) are admitted in order of a_{r,k} descending (ties: smaller k first, then smaller r);
    B starts at R and tau at R (one bonus token per request); the admission stops before the first
    candidate whose Theta = tau * SPS(B) is below the previous best. Vectorised as cumsum + first-fall index.
    The early stop is what makes it non-anticipating (Appendix A).
    """
    conf, cap = _check(conf, max_lengths)
    r = conf.shape[0]
    surv, req, e = _sorted_candidates(conf, cap)
    if e == 0:
        return torch.zeros(r, dtype=torch.long, device=conf.device)
    theta = _throughput_path(surv, r, sps_table)
    fall = theta[1:] < theta[:-1]  # fall[i] <=> admitting candidate i lowers Theta
    n = int(torch.argmax(fall.to(torch.uint8))) if bool(fall.any()) else e
    return _lengths_from_top(req, n, r)


def async_capacity(
    conf_stale: torch.Tensor, sps_table: SPSLike, max_lengths: torch.Tensor | None = None
) -> int:
    """Extra verify tokens K = B* - R chosen from stale confidences by an unconstrained global argmax of
    Theta over the whole path (no early stop; ties -> smallest K). Safe because the stale confidences
    are independent of the current round's drafts."""
    conf_stale, cap = _check(conf_stale, max_lengths)
    surv, _, e = _sorted_candidates(conf_stale, cap)
    if e == 0:
        return 0
    theta = _throughput_path(surv, conf_stale.shape[0], sps_table)
    return int(torch.argmax(theta))  # torch.argmax returns the first maximal index


def top_k_prefix(conf: torch.Tensor, k: int, max_lengths: torch.Tensor | None = None) -> torch.Tensor:
    """Admit the top-k candidates by fresh cumulative survival (prefix-consistent per request)."""
    conf, cap = _check(conf, max_lengths)
    _, req, e = _sorted_candidates(conf, cap)
    return _lengths_from_top(req, min(max(int(k), 0), e), conf.shape[0])


def hardware_aware_async(
    conf_stale: torch.Tensor | int | None,
    conf_fresh: torch.Tensor,
    sps_table: SPSLike | None = None,
    max_lengths: torch.Tensor | None = None,
    stale_max_lengths: torch.Tensor | None = None,
) -> torch.Tensor:
    """Production variant (paper §5.2): the capacity K is chosen from confidences two rounds old
    (``conf_stale`` [R', gamma], or a precomputed int K from :func:`async_capacity`), then the current
    round admits the top-K candidates by fresh cumulative survival. With ``conf_stale=None`` (first
    rounds) it falls back to :func:`hardware_aware_sync` on the fresh confidences."""
    if conf_stale is None:
        if sps_table is None:
            raise ValueError("hardware_aware_async needs sps_table when conf_stale is None.")
        return hardware_aware_sync(conf_fresh, sps_table, max_lengths)
    if isinstance(conf_stale, int):
        k = conf_stale
    else:
        if sps_table is None:
            raise ValueError("hardware_aware_async needs sps_table to turn conf_stale into a capacity.")
        k = async_capacity(conf_stale, sps_table, stale_max_lengths)
    return top_k_prefix(conf_fresh, k, max_lengths)


# ---------------------------------------------------------------------------- policy objects
@dataclass(frozen=True)
class SchedulerPolicy:
    """A named policy bound to its parameters: ``policy(conf, max_lengths=None, conf_stale=None)``.

    ``uses_stale`` tells the caller to keep confidences from two rounds back and pass them as
    ``conf_stale`` (only the async hardware-aware policy does).
    """

    name: str
    fn: Callable[..., torch.Tensor]
    params: dict[str, Any] = field(default_factory=dict)
    uses_stale: bool = False

    def __call__(
        self,
        conf: torch.Tensor,
        max_lengths: torch.Tensor | None = None,
        conf_stale: torch.Tensor | int | None = None,
    ) -> torch.Tensor:
        if self.uses_stale:
            return self.fn(conf_stale, conf, max_lengths=max_lengths, **self.params)
        return self.fn(conf, max_lengths=max_lengths, **self.params)


_ALIASES = {
    "fixed": "fixed",
    "fixed_length": "fixed",
    "threshold": "static_threshold",
    "static_threshold": "static_threshold",
    "hardware_aware": "hardware_aware",
    "hardware_aware_sync": "hardware_aware",
    "hardware_aware_async": "hardware_aware_async",
    "async": "hardware_aware_async",
}
POLICY_NAMES = tuple(sorted(_ALIASES))


def get_policy(name: str, **kw: Any) -> SchedulerPolicy:
    """Build a policy by name: ``fixed`` (gamma=), ``static_threshold`` (threshold=),
    ``hardware_aware`` (sps_table=), ``hardware_aware_async`` (sps_table=)."""
    canon = _ALIASES.get(name)
    if canon is None:
        raise ValueError(f"unknown scheduler policy {name!r}; choose one of {POLICY_NAMES}.")
    required = {
        "fixed": ("gamma",),
        "static_threshold": ("threshold",),
        "hardware_aware": ("sps_table",),
        "hardware_aware_async": ("sps_table",),
    }[canon]
    missing = [k for k in required if kw.get(k) is None]
    extra = [k for k in kw if k not in required]
    if missing or extra:
        raise ValueError(f"policy {name!r} takes exactly {required}; missing {missing}, unexpected {extra}.")
    if canon == "fixed":
        return SchedulerPolicy("fixed", fixed_length, {"gamma": int(kw["gamma"])})
    if canon == "static_threshold":
        return SchedulerPolicy("static_threshold", static_threshold, {"threshold": float(kw["threshold"])})
    if canon == "hardware_aware":
        return SchedulerPolicy("hardware_aware", hardware_aware_sync, {"sps_table": kw["sps_table"]})
    return SchedulerPolicy(
        "hardware_aware_async", hardware_aware_async, {"sps_table": kw["sps_table"]}, uses_stale=True
    )
