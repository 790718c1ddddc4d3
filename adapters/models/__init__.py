"""The adapters app's models. (Aliases are serving state: serving.models.)"""

from adapters.models.catalog import (
    Adapter,
    AdapterRevision,
    Approval,
    BaseModel,
    RevisionState,
    replicas_for,
    replicas_sql,
)
from adapters.models.evaluations import Evaluation, EvaluationState, EvaluationSuite
from adapters.models.uploads import UploadPart, UploadSession, UploadState

__all__ = [
    "Adapter",
    "AdapterRevision",
    "Approval",
    "BaseModel",
    "Evaluation",
    "EvaluationState",
    "EvaluationSuite",
    "RevisionState",
    "UploadPart",
    "UploadSession",
    "UploadState",
    "replicas_for",
    "replicas_sql",
]
