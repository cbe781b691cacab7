"""The compiled parts of hpcserve: contracts/_blockhash.c (the prefix routing's block hashes),
gateway/_json_scan.c (passes over a request body's raw JSON) and router/_few_rows.c (the
kv-aware policy's pick over a few replicas); everything else is in pyproject.toml."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "hpcserve.contracts._blockhash",
            sources=["contracts/_blockhash.c"],
            extra_compile_args=["-O3"],
        ),
        Extension(
            "hpcserve.gateway._json_scan",
            sources=["gateway/_json_scan.c"],
            extra_compile_args=["-O3"],
        ),
        Extension(
            "hpcserve.router._few_rows",
            sources=["router/_few_rows.c"],
            extra_compile_args=["-O3"],
        ),
    ]
)
