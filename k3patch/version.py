"""k3patch's version: the one place it is written (pyproject.toml reads it at build time)."""

VERSION = "0.1.0"
