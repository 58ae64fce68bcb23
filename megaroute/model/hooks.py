"""Whether a module's call could be observed by a hook: the fused paths that skip a module call
(MoD's router node) or rotate a projection's output in place (attention) check it first.

torch has no public way to list a module's hooks, so this reads its registries (the module's
`_forward_hooks` / `_forward_pre_hooks` and nn.modules.module's global ones). Where a torch version
keeps them elsewhere, the answer is "observed": the callers then take their plain paths, slower but
right, instead of failing or skipping a hook.
"""

from __future__ import annotations

from torch import nn

_LOCAL = {False: ("_forward_hooks",), True: ("_forward_hooks", "_forward_pre_hooks")}
_GLOBAL = {False: ("_global_forward_hooks",), True: ("_global_forward_hooks", "_global_forward_pre_hooks")}


def forward_observed(module: nn.Module, pre: bool = False) -> bool:
    """True when a forward hook on `module`, or a global one, could see or replace its output; with
    `pre`, forward pre-hooks (which see and may replace its input) count too. Also True when torch's
    hook registries are not where this looks for them."""
    registries = [getattr(module, name, None) for name in _LOCAL[pre]]
    registries += [getattr(nn.modules.module, name, None) for name in _GLOBAL[pre]]
    return any(registry is None or len(registry) > 0 for registry in registries)
