"""Every file loader of ftctl by name, for the bound and fuzz tests of `documents`."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from dynamo_ftctl.documents import load_yaml_document
from dynamo_ftctl.drill.scenario import load_scenario
from dynamo_ftctl.engine.config import resolve_engine_config
from dynamo_ftctl.health.canaryset import load_canary_set
from dynamo_ftctl.inventory import load_inventory
from dynamo_ftctl.migrate.calibrate import load_calibration

# The YAML files: each goes through documents.load_yaml_document.
YAML_LOADERS: dict[str, Callable[[Path], object]] = {
    "inventory": load_inventory,
    "canary-set": load_canary_set,
    "scenario": load_scenario,
    "engine-config": lambda p: resolve_engine_config(str(p)),
    "calibration": load_calibration,
    "yaml-document": load_yaml_document,
}

