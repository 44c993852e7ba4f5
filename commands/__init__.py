"""Command groups of the `areal` CLI: thin wrappers that parse flags, call the library, render."""
