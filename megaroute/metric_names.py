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

Causal-mode (evaluation) load and drops, and MoDE's run/skip vs expert choice, are in `megaroute audit`.
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

# Per-step routing stats of a routed layer (see the module docstring).
ROUTING = "routing"
EXPERT_LOAD_MAX = "moe_load_max"
EXPERT_DROPPED = "moe_dropped"
EXPERT_DROPPED_FRAC = "moe_dropped_frac"


def routing_stat(layer: str, stat: str) -> str:
    """routing/<layer>/<stat>, e.g. routing_stat("layer_1", EXPERT_DROPPED_FRAC)."""
    return f"{ROUTING}/{layer}/{stat}"


def expert_load(layer: str, expert: int) -> str:
    """routing/<layer>/expert_<e>_load: expert e's fraction of the layer's executed assignments."""
    return routing_stat(layer, f"expert_{expert}_load")


def expert_loads(metrics: dict[str, float]) -> dict[str, list[float]]:
    """Per layer, the expert_<e>_load values of a metrics dict (a step's metrics, an MLflow run's
    latest metrics), in expert order: {"layer_1": [load_0, load_1, ...]}."""
    found: dict[str, dict[int, float]] = {}
    for key, value in metrics.items():
        head, layer, stat = (key.split("/") + ["", ""])[:3]
        if head == ROUTING and stat.startswith("expert_") and stat.endswith("_load") and stat[7:-5].isdigit():
            found.setdefault(layer, {})[int(stat[7:-5])] = value
    return {layer: [by_e[e] for e in sorted(by_e)] for layer, by_e in found.items()}
