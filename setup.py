"""The packages, found when the wheel is built: every folder under patches/ with an __init__.py
is a patch, installed as `k3patch.patches.<folder>`. pyproject.toml holds everything else;
setuptools' `packages.find` there names a package after its folder, and patches/ installs as
`k3patch.patches` (no top-level `patches` in site-packages), so the prefix is added here."""

from setuptools import find_packages, setup

setup(
    packages=[
        *find_packages(include=["k3patch", "k3patch.*"]),
        "k3patch.patches",
        *(f"k3patch.patches.{name}" for name in find_packages("patches")),
    ]
)
