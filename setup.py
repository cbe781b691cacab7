"""The compiled part of hpcserve: router/_blockhash.c (everything else is in pyproject.toml)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "hpcserve.router._blockhash",
            sources=["router/_blockhash.c"],
            extra_compile_args=["-O3"],
        )
    ]
)
