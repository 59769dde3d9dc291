"""CLI subcommands, one module each (see rtckern/cli.py)."""
