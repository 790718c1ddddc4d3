"""Resumable uploads (adapters/uploads.py): a session and its parts."""

from __future__ import annotations

import uuid

from django.conf import settings
from django.db import models
from django.db.models import Q
from django.utils import timezone

from adapters.models.catalog import Adapter, AdapterRevision
from tenants.models import ApiKey, Tenant


class UploadState(models.TextChoices):
    OPEN = "open", "Open"
    COMPLETED = "completed", "Completed"
    ABORTED = "aborted", "Aborted"


class UploadSession(models.Model):
    """One archive sent in numbered parts that survive a dropped connection, then registered as a revision.

    The client declares the whole file (`size`, `sha256`, `filename`) up front, so size and quota are refused
    before a byte is stored; parts 1..n of `part_size` bytes (the last one shorter) arrive in any order and are
    kept in the artifact store under the tenant's prefix (adapters/uploads.py). An open session's declared size
    counts against the tenant's storage quota. Past `expires_at` (pushed back by each part) it is collected
    with its parts (adapters.tasks.upload_sessions_collect).
    """

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="upload_sessions")
    adapter = models.ForeignKey(Adapter, on_delete=models.CASCADE, related_name="upload_sessions")
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_by_key = models.ForeignKey(ApiKey, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    size = models.PositiveBigIntegerField(help_text="Bytes of the whole file, as declared.")
    sha256 = models.CharField(max_length=64, help_text="Hex SHA-256 of the whole file, as declared.")
    filename = models.CharField(max_length=255)
    part_size = models.PositiveBigIntegerField(help_text="Bytes of every part but the last (MINT_UPLOAD_PART_BYTES).")
    state = models.CharField(max_length=10, choices=UploadState.choices, default=UploadState.OPEN)
    # Set while one `complete` assembles and registers the file, so a second one (a client retrying after a
    # dropped answer) cannot register it twice; a claim older than a crash could hold is taken over.
    completing_since = models.DateTimeField(null=True, blank=True)
    # On the S3 store, the multipart upload its parts are sent to (adapters/uploads.py); empty on a filesystem
    # store, and once `complete` assembled the parts into one object (which is then read back, not the parts).
    s3_upload_id = models.CharField(max_length=1024, blank=True, default="")
    revision = models.ForeignKey(AdapterRevision, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    expires_at = models.DateTimeField()
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = [
            models.CheckConstraint(condition=Q(state__in=UploadState.values), name="upload_session_state_valid"),
            models.CheckConstraint(condition=Q(size__gte=1), name="upload_session_size_positive"),
            models.CheckConstraint(condition=Q(part_size__gte=1), name="upload_session_part_size_positive"),
        ]
        indexes = [
            # A tenant's open sessions (the open-session limit, the quota) and an adapter's (the list).
            models.Index(fields=["tenant", "state"], name="upload_session_tenant_state"),
            models.Index(fields=["adapter", "state", "-created_at"], name="upload_session_adapter_list"),
            # The collector: sessions past their expiry.
            models.Index(fields=["expires_at"], name="upload_session_expiry"),
        ]

    def __str__(self) -> str:
        return f"{self.adapter} upload {self.id}"

    @property
    def part_count(self) -> int:
        return -(-self.size // self.part_size)

    def expected_part_size(self, number: int) -> int:
        """Bytes part `number` (1..part_count) must have: part_size, except the last, which holds the rest."""
        if number < self.part_count:
            return self.part_size
        return self.size - self.part_size * (self.part_count - 1)


class UploadPart(models.Model):
    """One received part of an upload session, checked by `sha256`: its bytes are in the store (`store_path`), or
    on the S3 store a part of the session's multipart upload (`s3_etag`; `store_path` names the object it makes)."""

    session = models.ForeignKey(UploadSession, on_delete=models.CASCADE, related_name="parts")
    number = models.PositiveIntegerField()
    size = models.PositiveBigIntegerField()
    sha256 = models.CharField(max_length=64)
    store_path = models.CharField(max_length=500)
    # On the S3 store: the ETag S3 gave the part of the session's multipart upload (`complete` names it back).
    s3_etag = models.CharField(max_length=200, blank=True, default="")
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["session", "number"], name="upload_part_session_number_unique"),
            models.CheckConstraint(condition=Q(number__gte=1), name="upload_part_number_positive"),
        ]

    def __str__(self) -> str:
        return f"{self.session_id} part {self.number}"
