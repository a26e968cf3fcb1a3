"""``python -m stopcock``: the ``stopcock`` command line, through the command's own entry point."""

import sys

from _stopcock_launch import main

sys.exit(main())
