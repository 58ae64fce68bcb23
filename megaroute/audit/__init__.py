"""Routing audit: counterfactual routing, cross-layer statistics and stratified losses of a checkpoint."""

from .report import AUDITABLE, audit_model, load_run_model, write_report

__all__ = ["AUDITABLE", "audit_model", "load_run_model", "write_report"]
