"""`python -m ds_recycle ...` is the same as the `ds-recycle` console script."""
import sys

from ds_recycle.cli import main

sys.exit(main())
