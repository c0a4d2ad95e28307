"""Migration of broken streams, admission control and the migrating proxy.

Import-free on purpose: `continuation`, `admission`, `routing` and `proxy` are
imported by whoever needs them, so `import dynamo_ftctl.migrate` stays cheap.
"""
