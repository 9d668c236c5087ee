"""`python -m ds_recycle ...` is the same as the `ds-recycle` console script."""
from ds_recycle.cli import console

console()
