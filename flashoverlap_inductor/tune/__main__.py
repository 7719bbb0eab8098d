"""``python -m flashoverlap_inductor.tune``: the command line is ``flashoverlap_inductor/tools/tune.py``."""

import sys

from flashoverlap_inductor.tools.tune import main

sys.exit(main())
