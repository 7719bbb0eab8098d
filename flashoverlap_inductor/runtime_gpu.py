"""Deprecated name, kept for one release: the runtime is the route registry now (``flashoverlap_inductor.routes``).

``runtime_gpu.stats`` / ``check()`` / ``reset()`` are ``routes.stats`` / ``routes.check()`` / ``routes.reset()``.
Importing this module warns; nothing in the package imports it.
"""

import warnings

from .routes import check, reset, stats

warnings.warn("flashoverlap_inductor.runtime_gpu is deprecated: use flashoverlap_inductor.routes (stats, check, "
              "reset)", DeprecationWarning, stacklevel=2)

__all__ = ["check", "reset", "stats"]
