"""`python -m kdash ...`: the same as the `kdash` console script."""

import sys

from kdash.cli import main

sys.exit(main())
