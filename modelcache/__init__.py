"""The model registry and the node-local, digest-verified model cache (issue 6).

`hpcserve models add` hashes a model directory once into a digest manifest
(manifest.py) and records it with the version in the SQLite registry (registry.py).
Before vLLM starts, the engine job stages that version from the shared filesystem into
the node's cache directory (stage.py, copier.py): a parallel chunked copy that checks
every file's digest, published by one atomic rename, under a node-local lock so that
jobs on one node copy a model once (locks.py). The cache keeps pins, leases of running
engines (leases.py) and LRU eviction under a byte cap (cache.py); `hpcserve cache ...`
manages it (cli.py). Names, references and cache keys: refs.py; progress: progress.py.
"""
