"""`python -m gpuops.cli`: the gpuops command."""

from gpuops.cli import main

main()
