"""``python -m hpc_asyncppo COMMAND``: the ``hpc-asyncppo`` tool (``cli.py``)."""

import sys

from hpc_asyncppo.cli import main

sys.exit(main())
