"""`python -m areal_cli`: the same CLI as `areal`, for a venv where another package's `areal`
console script (AReaL >= 2.0 ships one) was installed last and shadows ours."""

from areal_cli.cli import main

if __name__ == "__main__":
    main()
