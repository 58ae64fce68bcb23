"""Routing audit: counterfactual routing, cross-layer statistics, stratified losses and expert load of a checkpoint.

The entry points live in `megaroute.audit.report` (audit_model, load_run_model, write_report); this package
module re-exports nothing, so importing `megaroute.audit.analysis` (e.g. sweep analysis's intervals) does not
pull in report's mlflow and transformers imports.
"""
