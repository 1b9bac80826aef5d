"""``python -m mtpquant``."""

import sys

from mtpquant.cli import main

sys.exit(main())
