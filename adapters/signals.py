"""Events of the adapter catalog that apps above it react to (adapters never imports them).

`evaluation_requested(evaluation_id=…)`: an Evaluation row was created or reset to `pending`, sent once its
transaction committed. serving connects its runner in `ServingConfig.ready` (serving.tasks.evaluation_run).

`revision_exported(revision_id=…, adapter_id=…)`: a revision's export was published, sent once committed. serving
runs the adapter's retention then (serving/services/retention.py), so storage falls as a pipeline pushes.

`storage_needed(tenant_id=…)`: a registration found the tenant's storage quota full, sent before it is refused
(outside any transaction); serving's retention archives what it would archive soon, and the registration checks
the quota again.
"""

from django.dispatch import Signal

evaluation_requested = Signal()
revision_exported = Signal()
storage_needed = Signal()
