"""`python -m tsrl_cli` is the same as the `tsrl` command."""

from tsrl_cli.cli import main

if __name__ == "__main__":
    main()
