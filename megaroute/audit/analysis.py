"""Pure functions behind `megaroute audit`: counterfactual masks and routing statistics.

A decision mask is [B, T] bool, True = the token executes the routed block at that layer. An
assignment matrix (Mixture-of-Experts) is [N, E] bool over N tokens, True = the token runs expert e.
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np
import torch
from scipy import stats
from scipy.stats.contingency import association


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


def expert_load(assign: torch.Tensor) -> dict:
    """Balance of one MoE layer's expert assignments [N, E] bool: per expert the assignments and their
    fraction of all, max / mean load (1 = balanced, E = one expert takes everything), the coefficient
    of variation std / mean of the loads (population std; 0 = balanced) and the load entropy
    normalised by log E (1 = balanced, 0 = one expert)."""
    load = assign.reshape(-1, assign.shape[-1]).sum(0).double().cpu().numpy()
    E, total = len(load), float(load.sum())
    mean = total / E
    out = {"assignments": [int(v) for v in load], "total": int(total),
           "fraction": [float(v / total) if total else math.nan for v in load],
           "max_over_mean": float(load.max() / mean) if total else math.nan,
           "cv": float(load.std() / mean) if total else math.nan,
           "entropy_norm": math.nan if not total else 1.0 if E == 1 else float(stats.entropy(load, base=E))}
    return out


def expert_drops(chosen: torch.Tensor, kept: torch.Tensor, routed: torch.Tensor) -> dict:
    """Tokens dropped by an MoE layer. chosen [N, E]: the assignments the router asked for (token
    choice: each token's top-k, before capacity); kept [N, E]: those that ran; routed [N]: the tokens
    the layer's router scored. Dropped assignments = chosen and not kept; a routed token with no kept
    assignment gets no routed-expert update (only the residual and any shared experts)."""
    chosen, kept, routed = chosen.reshape(-1, chosen.shape[-1]), kept.reshape(-1, kept.shape[-1]), routed.reshape(-1)
    n_chosen, n_dropped = int(chosen.sum()), int((chosen & ~kept).sum())
    tokens, without = int(routed.sum()), int((routed & ~kept.any(-1)).sum())
    return {"assignments": n_chosen, "assignments_dropped": n_dropped,
            "assignments_dropped_frac": n_dropped / n_chosen if n_chosen else math.nan,
            "tokens": tokens, "tokens_without_expert": without,
            "tokens_without_expert_frac": without / tokens if tokens else math.nan,
            "experts_per_token": int(kept[routed].sum()) / tokens if tokens else math.nan}


def decision_expert_association(run: torch.Tensor, expert: torch.Tensor, num_experts: int) -> dict:
    """How a run/skip decision relates to expert choice, over N tokens: run [N] bool, expert [N] int
    in [0, E) (e.g. each token's top-1 expert by router probability).

    The 2 x E contingency table (rows run, skip), the conditional shares P(run | expert e),
    P(expert e | run) and P(expert e | skip), and Cramer's V = sqrt(chi2 / (N (min(rows, cols) - 1)))
    of the table (scipy, no continuity correction) over the rows and columns that hold a token: 0 =
    the decision is independent of which expert a token prefers, 1 = the preferred expert determines
    it. NaN (with a note) when fewer than 2 rows or columns hold tokens (everything ran, or every
    token prefers one expert)."""
    run, expert = run.reshape(-1).bool().cpu().numpy(), expert.reshape(-1).long().cpu().numpy()
    table = np.zeros((2, num_experts), dtype=np.int64)
    np.add.at(table, (np.where(run, 0, 1), expert), 1)
    rows, cols = table.sum(1), table.sum(0)
    nz = table[rows > 0][:, cols > 0]
    note = ""
    if nz.shape[0] < 2 or nz.shape[1] < 2:
        v = math.nan
        note = "undefined: " + ("every token ran or every token skipped" if nz.shape[0] < 2
                                else "every token prefers the same expert")
    else:
        v = float(association(nz, method="cramer"))

    def share(num, den):
        return [float(a / b) if b else math.nan for a, b in zip(num, den)]

    return {"table": {"run": table[0].tolist(), "skip": table[1].tolist()}, "tokens": int(table.sum()),
            "cramers_v": v, "note": note, "p_run_given_expert": share(table[0], cols),
            "p_expert_given_run": share(table[0], [rows[0]] * num_experts),
            "p_expert_given_skip": share(table[1], [rows[1]] * num_experts)}


def share_by_position(flag: torch.Tensor, buckets: int) -> list[dict]:
    """Mean of a per-token flag [B, T] (e.g. skipped) within equal position buckets."""
    f = flag.double().mean(0).cpu()
    T = f.shape[0]
    edges = np.linspace(0, T, buckets + 1).astype(int)
    return [{"positions": f"{edges[i]}-{edges[i + 1] - 1}", "share": float(f[edges[i]:edges[i + 1]].mean())}
            for i in range(buckets) if edges[i + 1] > edges[i]]


def share_by_token(flag: torch.Tensor, tokens: torch.Tensor, top: int) -> list[dict]:
    """Mean of a per-token flag [B, T] per token id, for the `top` most frequent ids (ties: lower id)."""
    ids, counts = tokens.reshape(-1).cpu().unique(return_counts=True)
    f = flag.reshape(-1).double().cpu()
    t = tokens.reshape(-1).cpu()
    order = sorted(range(len(ids)), key=lambda i: (-int(counts[i]), int(ids[i])))[:top]
    return [{"token": int(ids[i]), "count": int(counts[i]), "share": float(f[t == ids[i]].mean())} for i in order]
