"""Routing audit: counterfactual routing, cross-layer statistics and stratified losses of a checkpoint."""

from .report import audit_model, auditable_methods, load_run_model, write_report

__all__ = ["audit_model", "auditable_methods", "load_run_model", "write_report"]
