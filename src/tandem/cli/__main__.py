"""``python -m tandem.cli`` (as ``torchrun -m tandem.cli train ...`` runs it)."""

import sys

from . import main

sys.exit(main())
