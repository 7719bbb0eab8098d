"""``python -m flashoverlap_inductor.demo``: the runner is ``flashoverlap_inductor/tools/demo.py``."""

import sys

from flashoverlap_inductor.tools.demo import main

sys.exit(main())
