"""``python -m rpcguard`` is the same as the ``rpcguard`` console script."""

import sys

from rpcguard.cli import main

sys.exit(main())
