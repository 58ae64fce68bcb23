"""Pure functions behind `megaroute audit`: counterfactual masks and routing statistics.

A decision mask is [B, T] bool, True = the token executes the routed block at that layer.
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np
import torch
from scipy import stats


def random_like(mask: torch.Tensor, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Uniform random positions with the same count per sequence as `mask`."""
    B, T = mask.shape
    noise = torch.rand(B, T, generator=generator).to(mask.device)
    ranks = noise.argsort(dim=1).argsort(dim=1)  # a random permutation rank per position
    return ranks < mask.sum(dim=1, keepdim=True)


def stride_like(mask: torch.Tensor) -> torch.Tensor:
    """Evenly spaced positions, as many per sequence as `mask` selects (a positional router)."""
    B, T = mask.shape
    k = mask.sum(dim=1, keepdim=True)
    t = torch.arange(T, device=mask.device).expand(B, T)
    # Position t is picked when the running share floor((t + 1) k / T) steps up: exactly k per row.
    return (t + 1) * k // T > t * k // T


def top_scores_like(mask: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """The highest-scoring positions (e.g. reference entropy), as many per sequence as `mask`."""
    ranks = scores.argsort(dim=1, descending=True).argsort(dim=1)
    return ranks < mask.sum(dim=1, keepdim=True)


def inverted(mask: torch.Tensor) -> torch.Tensor:
    return ~mask


def entropy(logits: torch.Tensor) -> torch.Tensor:
    """Predictive entropy (nats) per position: [B, T, V] -> [B, T]."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


def routing_correlation(decisions: dict[str, torch.Tensor]) -> dict:
    """Per pair of layers: correlation of per-token decisions (phi coefficient) and
    P(routed out at j | routed out at i)."""
    names = list(decisions)
    flat = {n: decisions[n].reshape(-1).float().cpu().numpy() for n in names}
    corr = np.full((len(names), len(names)), np.nan)
    cond = np.full((len(names), len(names)), np.nan)
    for a, i in enumerate(names):
        out_i = 1 - flat[i]
        for b, j in enumerate(names):
            out_j = 1 - flat[j]
            if flat[i].std() > 0 and flat[j].std() > 0:
                corr[a, b] = float(np.corrcoef(flat[i], flat[j])[0, 1])
            elif a == b:
                corr[a, b] = 1.0  # a constant decision is trivially identical to itself
            if out_i.sum() > 0:
                cond[a, b] = float((out_i * out_j).sum() / out_i.sum())
    return {"layers": names, "correlation": corr.tolist(), "p_out_j_given_out_i": cond.tolist()}


def stratified(values: dict[str, torch.Tensor], strata: torch.Tensor, bins: int) -> dict:
    """Mean of each per-token value (e.g. routed and dense loss) within quantile bins of `strata`.

    Bins hold (almost) equal token counts; count-weighted bin means average back to the overall mean.
    """
    s = strata.reshape(-1).float().cpu()
    order = s.argsort()
    edges = np.linspace(0, len(order), bins + 1).astype(int)
    rows = []
    for b in range(bins):
        sel = order[edges[b]:edges[b + 1]]
        if len(sel) == 0:
            continue
        row = {"bin": b, "count": int(len(sel)), "strata_min": float(s[sel].min()), "strata_max": float(s[sel].max())}
        for name, v in values.items():
            row[name] = float(v.reshape(-1).float().cpu()[sel].mean())
        rows.append(row)
    overall = {name: float(v.float().mean()) for name, v in values.items()}
    return {"bins": rows, "overall": overall}


def agreement_by_position(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], buckets: int) -> dict:
    """Agreement of two sets of decisions (e.g. causal vs teacher-forced top-k) by position bucket."""
    same = torch.stack([(a[n] == b[n]).float() for n in a]).mean(dim=(0, 1)).cpu()  # [T]
    T = same.shape[0]
    edges = np.linspace(0, T, buckets + 1).astype(int)
    rows = [{"positions": f"{edges[i]}-{edges[i + 1] - 1}", "agreement": float(same[edges[i]:edges[i + 1]].mean())}
            for i in range(buckets) if edges[i + 1] > edges[i]]
    return {"overall": float(same.mean()), "by_position": rows}


def t_interval(values: list[float], confidence: float = 0.95) -> dict:
    """Mean, sample standard deviation and the Student-t confidence interval of the mean:
    mean +- t_{(1+confidence)/2, n-1} * std / sqrt(n).

    With n seeds the interval has n - 1 degrees of freedom, so it widens sharply for few seeds
    (t = 12.71 at n = 2, 4.30 at n = 3 for 95%); that is the honest width. Under n = 3 the result
    carries a `note` saying so; under n = 2 there is no interval at all (`ci_low`/`ci_high` are NaN
    and the note says why)."""
    x = np.asarray(values, dtype=float)
    n = len(x)
    out = {"n": n, "mean": float(x.mean()) if n else math.nan, "std": float(x.std(ddof=1)) if n > 1 else math.nan,
           "half_width": math.nan, "ci_low": math.nan, "ci_high": math.nan, "confidence": confidence,
           "method": "student-t", "note": ""}
    if n < 2:
        out["note"] = f"n={n}: no interval (needs at least 2 seeds)"
        return out
    t = float(stats.t.ppf((1 + confidence) / 2, n - 1))
    out["half_width"] = t * out["std"] / math.sqrt(n)
    out["ci_low"], out["ci_high"] = out["mean"] - out["half_width"], out["mean"] + out["half_width"]
    if n < 3:
        out["note"] = f"n={n} < 3: {n - 1} degree of freedom (t={t:.2f}), the interval is very wide; run more seeds"
    return out


def seed_variance(final_losses: dict[str, dict[str, float]], baseline="dense", confidence: float = 0.95) -> dict:
    """final_losses: variant -> {seed: final loss}. Per variant: `t_interval` of the mean over seeds.
    Per routed variant: `t_interval` of the PAIRED differences routed - baseline over the seeds both
    have (seed s of the routed variant minus seed s of its baseline), which removes the variance the
    two share through the seed; seeds only one side has are listed under `unpaired`.

    `baseline`: one variant name every other variant is compared with, or a dict variant -> its
    baseline variant (variants absent from it get no difference)."""
    pairs = baseline if isinstance(baseline, dict) else {v: baseline for v in final_losses if v != baseline}
    out = {"variants": {v: t_interval(list(by_seed.values()), confidence) for v, by_seed in final_losses.items()},
           "differences": {}}
    for v, base_name in pairs.items():
        by_seed, base = final_losses.get(v, {}), final_losses.get(base_name, {})
        if v == base_name or not by_seed or not base:
            continue
        seeds = sorted(set(by_seed) & set(base), key=_seed_key)
        out["differences"][v] = {
            "baseline": base_name, "seeds": seeds,
            "unpaired": sorted(set(by_seed) ^ set(base), key=_seed_key),
            **t_interval([by_seed[s] - base[s] for s in seeds], confidence),
        }
    return out


def _seed_key(seed: str):
    """Numeric seeds in numeric order, then anything else (run ids standing in for a missing seed tag)."""
    try:
        return (0, int(seed), "")
    except ValueError:
        return (1, 0, seed)
