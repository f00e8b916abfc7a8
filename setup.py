"""The package list, found rather than written down: `k3patch` and every package under the
repository's `patches/` (installed as `k3patch.patches.*`, see pyproject's package-dir), so a
fifth patch folder is installed with no edit here or in pyproject.toml."""

from setuptools import find_packages, setup

patches = find_packages(include=["patches", "patches.*"])
setup(packages=["k3patch", *(f"k3patch.{name}" for name in patches)])
