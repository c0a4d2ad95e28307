"""What each worker supports, found by probing it: token ids, /tokenize, /health, metrics, ...

This package owns capability discovery, one noun per module:

- `probe`: the probes (`probe_capabilities`) and the frozen answer (`Capabilities`);
- `cache`: a per-worker cache that de-duplicates concurrent probes and forgets a
  worker when it fails or restarts (`CapabilityCache`);
- `report`: the one-shot fleet report behind `ftctl inventory show --probe`
  (`probe_inventory_sync`);
- `fetch`: the probes' body cap and their default transport (`probe_client`, an
  `http1.Client`); every probe is one `http1.Request` through an `http1.AsyncTransport`.

It knows nothing about routing: what the proxy does with an answer is the
proxy's business.
"""

from __future__ import annotations

from dynamo_ftctl.capabilities.cache import CapabilityCache
from dynamo_ftctl.capabilities.fetch import MAX_PROBE_BYTES, probe_client
from dynamo_ftctl.capabilities.probe import (
    DEFAULT_TIMEOUT_S,
    KV_USAGE_METRICS,
    PROBE_PROMPT,
    Capabilities,
    LoadMetric,
    known_good_failure,
    known_good_request,
    load_metric_from_metrics,
    probe_capabilities,
    start_time_from_metrics,
)
from dynamo_ftctl.capabilities.report import (
    CapabilityReport,
    probe_inventory,
    probe_inventory_sync,
)

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "KV_USAGE_METRICS",
    "MAX_PROBE_BYTES",
    "PROBE_PROMPT",
    "Capabilities",
    "CapabilityCache",
    "CapabilityReport",
    "LoadMetric",
    "known_good_failure",
    "known_good_request",
    "load_metric_from_metrics",
    "probe_capabilities",
    "probe_client",
    "probe_inventory",
    "probe_inventory_sync",
    "start_time_from_metrics",
]
