"""The compiled part of hpcserve: contracts/_blockhash.c (everything else is in pyproject.toml)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "hpcserve.contracts._blockhash",
            sources=["contracts/_blockhash.c"],
            extra_compile_args=["-O3"],
        )
    ]
)
