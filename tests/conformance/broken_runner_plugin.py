"""runner_plugin.py with a planted bug: its runner drops the last known token of every
sequence before the forward. Tier T3 must refuse it."""

from __future__ import annotations

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "_tokenmill_test_runner_plugin_broken", Path(__file__).with_name("runner_plugin.py")
)
_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_module)
_module.BUG = "drops_last_token"
_module.NAME = "hfrunner-broken"

tokenmill_api_version = _module.tokenmill_api_version
tokenmill_detect = _module.tokenmill_detect
tokenmill_platform = _module.tokenmill_platform
tokenmill_attention_backends = _module.tokenmill_attention_backends
tokenmill_allocator = _module.tokenmill_allocator
tokenmill_hardware_spec = _module.tokenmill_hardware_spec
tokenmill_model_runner = _module.tokenmill_model_runner
