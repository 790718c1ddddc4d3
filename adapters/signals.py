"""Events of the adapter catalog that apps above it react to (adapters never imports them).

`evaluation_requested(evaluation_id=…)`: an Evaluation row was created or reset to `pending`, sent once its
transaction committed. serving connects its runner in `ServingConfig.ready` (serving.tasks.evaluation_run).
"""

from django.dispatch import Signal

evaluation_requested = Signal()
