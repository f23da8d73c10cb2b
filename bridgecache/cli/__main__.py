"""`python -m bridgecache.cli ...`: the `bridgecache` command, for where its script is not on PATH."""

import sys

from bridgecache.cli import main

sys.exit(main())
