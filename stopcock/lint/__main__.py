"""``python -m stopcock.lint PATH...``: the same as ``stopcock check``."""

import sys

from .cli import main

sys.exit(main())
