"""Build hook: the cffi extension (see cffi_build.py). All metadata lives in pyproject.toml."""

from setuptools import setup

setup(cffi_modules=["cffi_build.py:ffibuilder"])
