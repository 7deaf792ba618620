"""`python -m hvdtrain` is the `hvdtrain` command."""

from hvdtrain.cli import main

if __name__ == "__main__":
    main()
