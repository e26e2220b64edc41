"""The documented import path of the Prometheus exporter (docs/contract.md): the telemetry
itself is the runtime's (``iosched/runtime/_telemetry.py``)."""

from .runtime._telemetry import start_exporter

__all__ = ["start_exporter"]
