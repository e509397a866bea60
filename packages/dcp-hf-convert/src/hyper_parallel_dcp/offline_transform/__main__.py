"""``python -m hyper_parallel_dcp.offline_transform`` = ``hp-dcp-convert``."""

import sys

from .cli import main

sys.exit(main())
