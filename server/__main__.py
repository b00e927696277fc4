"""python -m batchd.server: the same as `batchd serve`."""

import sys

from batchd.server.cli import main

sys.exit(main(["serve", *sys.argv[1:]]))
