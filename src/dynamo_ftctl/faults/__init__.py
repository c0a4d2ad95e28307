"""Fault catalog, Xid facts, injectors, the TCP fault proxy and the drill runner."""

__all__: list[str] = []
