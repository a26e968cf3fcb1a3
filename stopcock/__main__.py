"""``python -m stopcock``: the ``stopcock`` command line (:func:`stopcock.cli.main`)."""

import sys

from stopcock.cli import main

sys.exit(main())
