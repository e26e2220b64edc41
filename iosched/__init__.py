"""iosched: the storage layer for mixture-of-experts engines that stream experts from disk.

```python
store = await ExpertStore.open("ckpt/", budget_bytes=8 << 30)
async with store.acquire((layer, expert)) as view:   # leased: cannot be evicted while held
    compute(view.tensors)
```

``__all__`` is the package's API; with the public modules ``iosched.settings`` (the settings
table and its override) and ``iosched.topology`` (drives and topology files), and the public
modules of ``iosched.backends`` and ``iosched.residency``, it is all the command-line tools
(``iosched.tools``) import: docs/design.md, "Import rules".
"""

from ._errors import (
    BackendUnavailable,
    BudgetError,
    CheckpointError,
    ChecksumError,
    InvariantError,
    ReadError,
    StoreClosed,
    StoreError,
    UnknownExpertError,
)
from ._layout import (
    CheckpointIndex,
    DerivedTensor,
    ExpertKey,
    ExpertLayout,
    Extent,
    GgmlType,
    SkippedTensors,
    TensorSpec,
)
from ._settings import override as override_settings
from .formats._checkpoint import load_index
from .formats._manifest import ManifestSummary, default_manifest_path, write_manifest
from .formats._pack import ExpertMove, PackError, PackReport, Placement, pack_checkpoint
from .runtime._growth import GrowthDecision, GrowthStats, GrowthStep
from .runtime._lease import ArrivalGroup, Lease, LeaseGroup, ThreadArrivals
from .runtime._stats import DeviceStats, ReplicaStats, RequestTally, StoreStats, TierStats
from .runtime._store import ExpertStore
from .runtime._view import ExpertView

__all__ = [
    "ArrivalGroup",
    "BackendUnavailable",
    "BudgetError",
    "CheckpointError",
    "CheckpointIndex",
    "ChecksumError",
    "DerivedTensor",
    "DeviceStats",
    "ExpertKey",
    "ExpertLayout",
    "ExpertMove",
    "ExpertStore",
    "ExpertView",
    "Extent",
    "GgmlType",
    "GrowthDecision",
    "GrowthStats",
    "GrowthStep",
    "InvariantError",
    "Lease",
    "LeaseGroup",
    "ManifestSummary",
    "PackError",
    "PackReport",
    "Placement",
    "ReadError",
    "ReplicaStats",
    "RequestTally",
    "SkippedTensors",
    "StoreClosed",
    "StoreError",
    "StoreStats",
    "TensorSpec",
    "ThreadArrivals",
    "TierStats",
    "UnknownExpertError",
    "default_manifest_path",
    "load_index",
    "override_settings",
    "pack_checkpoint",
    "write_manifest",
]

__version__ = "0.1.0"
