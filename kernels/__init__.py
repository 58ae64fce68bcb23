"""Fused token-dispatch kernels for routed layers, importable as `megaroute.kernels`.

The routed layers call dispatch through `megaroute.routing.dispatch`, whose pure-PyTorch
functions define the semantics. Triton kernels with identical semantics land here with the
fused-dispatch work (issue 7); until then there is nothing to import but this docstring.
"""
