"""megaroute: scale-out pretraining for routed transformers."""

import os as _os

__version__ = "0.1.0"

# The top-level kernels/ directory ships as `megaroute.kernels` (setup.py's package_dir does that
# for installs). In a source checkout used via PYTHONPATH nothing maps it, so the checkout root
# joins this package's search path; `megaroute/` stays first, so its own subpackages win.
_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isfile(_os.path.join(_root, "setup.py")) and _os.path.isfile(_os.path.join(_root, "kernels", "__init__.py")):
    __path__.append(_root)
