"""GPU health: NVML status and events, the kernel-log Xid parser, fleet failure math.

Submodules are imported directly (`dynamo_ftctl.gpu.kmsg`, `.nvml`, ...): this
package imports nothing so that the fast kernel-log parser never loads NVML.
"""

__all__: list[str] = []
