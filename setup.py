"""Builds the native core (csrc/*.cpp) into one shared library loaded through ctypes.

The library has a plain C ABI: no Python or torch headers, so the binary does not depend on the
torch build. No -march flag: each SIMD kernel carries its own target attribute and the path is
chosen at run time from cpuid, so the wheel runs on any x86-64.
"""
import glob
import platform

from setuptools import Extension, setup

is_x86 = platform.machine().lower() in ("x86_64", "amd64", "i686", "x86")
flags = ["-O3", "-std=c++17", "-ffp-contract=off", "-fPIC", "-pthread", "-fvisibility=hidden", "-Wall", "-Wextra"]

setup(
    ext_modules=[
        Extension(
            "infinity._native._C",
            sources=sorted(glob.glob("csrc/*.cpp")),
            include_dirs=["csrc"],
            language="c++",
            extra_compile_args=flags,
            extra_link_args=["-pthread"],
        )
    ]
)
