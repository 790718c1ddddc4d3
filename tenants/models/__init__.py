"""Tenants, their members and roles, their API keys, and the audit log they share."""

from tenants.models.audit import AuditEvent
from tenants.models.idempotency import IdempotencyRecord
from tenants.models.keys import ApiKey, Scope
from tenants.models.members import Invitation, Membership, Role
from tenants.models.sso import IdentityProvider, SsoIdentity
from tenants.models.tenant import Tenant

__all__ = [
    "ApiKey",
    "AuditEvent",
    "IdempotencyRecord",
    "IdentityProvider",
    "Invitation",
    "Membership",
    "Role",
    "Scope",
    "SsoIdentity",
    "Tenant",
]
