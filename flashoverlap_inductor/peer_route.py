"""Deprecated name, kept for one release: the peer route is ``flashoverlap_inductor.routes.peer`` now.

``peer_route.reset()`` (collective: every rank calls it) is ``routes.reset()``, which also resets the ring and the
registry's memo. Importing this module warns; nothing in the package imports it.
"""

import warnings

from .routes import reset

warnings.warn("flashoverlap_inductor.peer_route is deprecated: use flashoverlap_inductor.routes.reset() and "
              "flashoverlap_inductor.routes.peer", DeprecationWarning, stacklevel=2)

__all__ = ["reset"]
