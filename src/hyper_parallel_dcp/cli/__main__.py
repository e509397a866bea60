"""``python -m hyper_parallel_dcp.cli`` runs ``hp-dcp``."""

import sys

from . import main

sys.exit(main())
