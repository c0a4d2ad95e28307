"""Paged KV blocks: layout math, the block copier on torch streams, checksums, benchmarks.

Submodules are imported directly (`dynamo_ftctl.kv.layout`, `.copy`, `.bench`):
this package imports nothing, so the cost model can use the layout math
without loading torch.
"""

__all__: list[str] = []
