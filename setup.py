"""Package discovery only (metadata is in pyproject.toml): the top-level kernels/ directory
ships as the subpackage `megaroute.kernels`, which pyproject's find directive cannot express."""

from setuptools import find_packages, setup

setup(
    packages=find_packages(include=["megaroute", "megaroute.*"]) + ["megaroute.kernels"],
    package_dir={"megaroute.kernels": "kernels"},
)
