"""The contracts every component may import: wire messages and their codecs, block hashing,
the router client, the health policy table, the batch store's read side, engine arguments."""
