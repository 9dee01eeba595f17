"""`python -m lmstack` (what `torchrun -m lmstack serve STACK` runs on every rank)."""

import sys

from lmstack.cli import main

sys.exit(main())
