"""``python -m sinklab.cli``: the same as the ``sinklab`` console script."""

from . import main

main()
