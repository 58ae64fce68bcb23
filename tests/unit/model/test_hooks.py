"""hooks.forward_observed: the check the fused paths make before skipping a module call or rotating
its output in place."""

from __future__ import annotations

from torch import nn

from megaroute.model.hooks import forward_observed


def test_forward_hooks_local_and_global_are_seen_and_pre_hooks_only_when_asked():
    module = nn.Linear(4, 4)
    assert not forward_observed(module) and not forward_observed(module, pre=True)
    handle = module.register_forward_hook(lambda m, args, out: None)
    assert forward_observed(module) and forward_observed(module, pre=True)
    handle.remove()
    handle = module.register_forward_pre_hook(lambda m, args: None)
    assert not forward_observed(module) and forward_observed(module, pre=True)
    handle.remove()
    for register, pre_only in ((nn.modules.module.register_module_forward_hook, False),
                               (nn.modules.module.register_module_forward_pre_hook, True)):
        handle = register(lambda *args: None)
        try:
            assert forward_observed(module) is not pre_only and forward_observed(module, pre=True)
        finally:
            handle.remove()
    assert not forward_observed(module) and not forward_observed(module, pre=True)


def test_registries_torch_keeps_elsewhere_count_as_observed(monkeypatch):
    """A torch that moved its hook registries: the answer is "observed", so the plain paths run."""
    module = nn.Linear(4, 4)
    monkeypatch.delattr(nn.modules.module, "_global_forward_pre_hooks")
    assert not forward_observed(module) and forward_observed(module, pre=True)
    monkeypatch.delattr(module, "_forward_hooks")
    assert forward_observed(module)
