"""`python -m engine.cli`: the gpuops command."""

from engine.cli import main

main()
