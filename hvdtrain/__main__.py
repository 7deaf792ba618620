"""`python -m hvdtrain` is the `hvdtrain` command."""

from hvdtrain.cli import main

main()
