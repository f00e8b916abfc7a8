"""`python -m k3patch` and the `k3patch` console script."""

from __future__ import annotations


def main() -> None:
    from k3patch.cli import app

    app(prog_name="k3patch")


if __name__ == "__main__":
    main()
