"""Node-local, digest-verified model cache staged from a shared filesystem.

Not built yet: issue 6 owns this package. Until then engines load weights from
the path in the pool config directly.
"""
