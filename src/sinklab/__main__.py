"""``python -m sinklab`` (and ``torchrun … -m sinklab``, ``accelerate launch -m sinklab``): the ``sinklab`` CLI."""

from .cli import main

main()
