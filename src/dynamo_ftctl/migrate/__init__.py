"""Moving one request from one worker to another: exporting and importing its state
(`transfer`), the cost model that chooses how (`cost`) and its calibration
(`calibrate`), and the KV handoff of a live stream (`handoff`).

The migrating proxy that uses them is `dynamo_ftctl.proxy`. Import-free on purpose:
each module is imported by whoever needs it, so `import dynamo_ftctl.migrate` stays cheap.
"""

__all__: list[str] = []
