"""``python -m hyper_parallel_dcp`` runs the end-to-end CPU demo."""

import sys

from hyper_parallel_dcp.demo import main

if __name__ == "__main__":
    sys.exit(main())
