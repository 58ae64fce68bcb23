"""Names of the evaluation metrics a run logs, for the code that writes them and the code that
reads them back (sweep analyze, compare, audit, demo, the MLflow run description).

    eval/loss            THE comparison metric: the autoregressive loss, each token routed from its own
                         past only (routed methods in their causal mode, halting in its hard mode,
                         dense as is), at the compute reported beside it in eval/exec_frac
    eval/exec_frac       fraction of tokens that took the budgeted path (the routed block, the full
                         FFN) in that mode, mean over routed layers; eval/exec_frac/<layer> per layer
    eval/budget          the fraction the method's budget says (methods that have one)
    eval/best_loss, eval/avg_loss, eval/threshold_hit_step/<t>   running summaries of eval/loss
    val/loss_<mode>      the other evaluation modes, under their own names; val/loss_topk routes by
                         sequence-wide top-k as in training (it sees future tokens), so it is not
                         comparable with eval/loss

Training steps also log each routed layer's stats as routing/<layer>/<stat> (layer = layer_<i>, the
block index; train/loop.py): rank 0's training-mode (top-k) forwards, mean over the step's
micro-batches. Mixture-of-Experts layers (moe, mode_staged, mode_integrated; model/routing/moe.py):

    routing/<layer>/expert_<e>_load   fraction of the layer's executed expert assignments that went to
                                      expert e (after capacity drops; sums to 1 over e)
    routing/<layer>/moe_load_max      max over experts of load / mean load (1 = balanced, E = one expert)
    routing/<layer>/moe_dropped       token choice: assignments dropped past an expert's capacity in one
                                      micro-batch (a count: it scales with the micro-batch)
    routing/<layer>/moe_dropped_frac  token choice: the dropped share of the assignments the router chose

Each evaluation also logs the same layers' load in causal mode (what eval/loss runs: token choice
takes every token's top-k and never drops, expert choice and MoDE decide by calibrated thresholds),
mean over the evaluation batches and data-parallel ranks, under the `routing_causal` head:

    routing_causal/<layer>/expert_<e>_load, routing_causal/<layer>/moe_load_max

(no drop stats: causal mode drops nothing). Per-token detail, and MoDE's run/skip vs expert choice,
are in `megaroute audit` (its "topk" and "causal" modes).
"""

from __future__ import annotations

LOSS = "eval/loss"
EXEC_FRAC = "eval/exec_frac"
BUDGET = "eval/budget"
BEST_LOSS = "eval/best_loss"
AVG_LOSS = "eval/avg_loss"
THRESHOLD_HIT = "eval/threshold_hit_step"
TOPK_LOSS = "val/loss_topk"

# What tables print beside the loss they report.
LOSS_LABEL = "eval/loss (autoregressive: causal routing, no future tokens)"
TRAIN_LOSS = "train/loss"
# Losses that are not autoregressive for routed runs, with what makes them so (plots and tables print it).
CAVEATS = {
    TRAIN_LOSS: "the training forward: routed runs route by sequence-wide top-k (sees future tokens) or "
                "soft gates; not comparable across methods",
    TOPK_LOSS: "top-k routing as in training: sees future tokens; not comparable",
    "val/loss_soft": "halting's soft forward: every token runs every block (full compute), not the hard skip",
}


def metric_label(key: str) -> str:
    """A metric's name as plots title it: eval/loss with LOSS_LABEL's gloss, a loss that is not
    autoregressive for routed runs with its caveat, anything else as is."""
    if key == LOSS:
        return LOSS_LABEL
    return f"{key} ({CAVEATS[key]})" if key in CAVEATS else key

# Per-step routing stats of a routed layer (see the module docstring).
ROUTING = "routing"
ROUTING_CAUSAL = "routing_causal"  # the same stats, from evaluation's causal-mode forwards
EXPERT_LOAD_MAX = "moe_load_max"
EXPERT_DROPPED = "moe_dropped"
EXPERT_DROPPED_FRAC = "moe_dropped_frac"


def routing_stat(layer: str, stat: str, head: str = ROUTING) -> str:
    """<head>/<layer>/<stat>, e.g. routing_stat("layer_1", EXPERT_DROPPED_FRAC) (head: ROUTING or ROUTING_CAUSAL)."""
    return f"{head}/{layer}/{stat}"


def expert_load(layer: str, expert: int, head: str = ROUTING) -> str:
    """<head>/<layer>/expert_<e>_load: expert e's fraction of the layer's executed assignments."""
    return routing_stat(layer, f"expert_{expert}_load", head)


def _expert_index(stat: str) -> int | None:
    """e of an expert_<e>_load stat name, else None."""
    return int(stat[7:-5]) if stat.startswith("expert_") and stat.endswith("_load") and stat[7:-5].isdigit() else None


def is_expert_stat(stat: str) -> bool:
    """A layer stat that describes expert load: expert_<e>_load or moe_load_max."""
    return stat == EXPERT_LOAD_MAX or _expert_index(stat) is not None


def expert_loads(metrics: dict[str, float], head: str = ROUTING) -> dict[str, list[float]]:
    """Per layer, the expert_<e>_load values of a metrics dict (a step's metrics, an MLflow run's
    latest metrics; head ROUTING_CAUSAL: an evaluation's), in expert order: {"layer_1": [load_0, ...]}."""
    found: dict[str, dict[int, float]] = {}
    for key, value in metrics.items():
        h, layer, stat = (key.split("/") + ["", ""])[:3]
        if h == head and (e := _expert_index(stat)) is not None:
            found.setdefault(layer, {})[e] = value
    return {layer: [by_e[e] for e in sorted(by_e)] for layer, by_e in found.items()}
