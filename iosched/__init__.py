"""iosched: the storage layer for mixture-of-experts engines that stream experts from disk.

```python
store = await ExpertStore.open("ckpt/", budget_bytes=8 << 30)
async with store.acquire((layer, expert)) as view:   # leased: cannot be evicted while held
    compute(view.tensors)
```
"""

from ._errors import (
    BackendUnavailable,
    BudgetError,
    CheckpointError,
    InvariantError,
    ReadError,
    StoreClosed,
    StoreError,
    UnknownExpertError,
)
from ._layout import CheckpointIndex, ExpertKey, ExpertLayout, Extent, TensorSpec
from ._lease import Lease, LeaseGroup
from ._settings import override as override_settings
from ._stats import StoreStats
from ._store import ExpertStore
from ._view import ExpertView

__all__ = [
    "BackendUnavailable",
    "BudgetError",
    "CheckpointError",
    "CheckpointIndex",
    "ExpertKey",
    "ExpertLayout",
    "ExpertStore",
    "ExpertView",
    "Extent",
    "InvariantError",
    "Lease",
    "LeaseGroup",
    "ReadError",
    "StoreClosed",
    "StoreError",
    "StoreStats",
    "TensorSpec",
    "UnknownExpertError",
    "override_settings",
]

__version__ = "0.1.0"
