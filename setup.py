"""Builds the native kernels (native._fermoe_native, cffi API mode) during `pip install -e .`.

Everything else about the package lives in pyproject.toml.
"""
from setuptools import setup
from setuptools.command.build_ext import build_ext
from setuptools.errors import CCompilerError, CompileError, ExecError, LinkError, PlatformError


class BuildExtReadable(build_ext):
    """Reports a failed C build in one line instead of a distutils traceback."""

    def run(self):
        try:
            super().run()
        except (CCompilerError, CompileError, ExecError, LinkError, PlatformError) as e:
            raise SystemExit(f"fermoe: building the native kernels failed: {e}\n"
                             "They need a working C compiler (gcc): install it, "
                             "then run pip install -e . again") from None


setup(cffi_modules=["native/build_native.py:ffibuilder"], cmdclass={"build_ext": BuildExtReadable})
