"""Packaging glue pyproject.toml cannot express: ship the top-level kernel_sources/ inside the package as
``rtckern/kernel_sources`` so a plain (non-editable) install compiles kernels from any directory."""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py


class build_py_with_kernel_sources(build_py):
    def run(self):
        super().run()
        src = Path(__file__).parent / "kernel_sources"
        dst = Path(self.build_lib) / "rtckern" / "kernel_sources"
        if dst.exists():
            shutil.rmtree(dst)
        shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))


setup(cmdclass={"build_py": build_py_with_kernel_sources})
