"""Fault catalog, Xid facts, injectors, the TCP fault proxy and the drill runner."""
