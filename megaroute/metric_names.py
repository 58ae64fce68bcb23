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
