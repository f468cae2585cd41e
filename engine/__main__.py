"""python -m engine: the command line (engine.cli)."""

from .cli import main

main()
