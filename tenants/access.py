"""Who is calling, for which tenant, and what they may do.

A person acts with the capabilities of their role in the tenant; a key acts with the
capabilities its scopes name. Every API view declares the capability each method
needs, and `TenantPermission` checks it once, so no view re-implements the rules.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from django.contrib.auth.models import AbstractBaseUser

from tenants.models import ApiKey, Role, Scope, Tenant


class Capability(StrEnum):
    READ = "read"  # the tenant's catalog, revisions and audit log
    REGISTER = "register"  # create adapters, register revisions, request approval
    DECIDE = "decide"  # approve, reject, activate, roll back
    MANAGE_KEYS = "manage_keys"  # create, list and revoke API keys
    INFERENCE = "inference"  # the OpenAI-compatible gateway


ROLE_CAPABILITIES: dict[str, frozenset[Capability]] = {
    Role.VIEWER: frozenset({Capability.READ}),
    Role.DEVELOPER: frozenset({Capability.READ, Capability.REGISTER}),
    Role.APPROVER: frozenset({Capability.READ, Capability.REGISTER, Capability.DECIDE}),
    Role.OWNER: frozenset({Capability.READ, Capability.REGISTER, Capability.DECIDE, Capability.MANAGE_KEYS}),
}

SCOPE_CAPABILITIES: dict[str, frozenset[Capability]] = {
    Scope.INFERENCE: frozenset({Capability.INFERENCE}),
    Scope.PIPELINE: frozenset({Capability.READ, Capability.REGISTER}),
    Scope.DEPLOY: frozenset({Capability.READ, Capability.DECIDE}),
}


# For error messages: which roles and scopes grant a capability.
def roles_granting(capability: Capability) -> list[str]:
    return [role for role, caps in ROLE_CAPABILITIES.items() if capability in caps]


def scopes_granting(capability: Capability) -> list[str]:
    return [scope for scope, caps in SCOPE_CAPABILITIES.items() if capability in caps]


@dataclass(frozen=True)
class Actor:
    """Who did something, for the audit log and for four-eyes: a person, a key, or the system."""

    user: AbstractBaseUser | None = None
    key: ApiKey | None = None

    @classmethod
    def system(cls) -> Actor:
        return cls()

    @property
    def person(self) -> AbstractBaseUser | None:
        """The person responsible: a key acts as the user who created it."""
        if self.key is not None:
            return self.key.created_by
        return self.user

    @property
    def label(self) -> str:
        if self.key is not None:
            return f"key:{self.key.prefix} ({self.key.name})"
        if self.user is not None:
            return self.user.get_username()
        return "system"


@dataclass(frozen=True)
class Access:
    """A resolved caller: the tenant it acts in and what it may do there."""

    tenant: Tenant
    actor: Actor
    role: str | None
    capabilities: frozenset[Capability]

    def can(self, capability: Capability) -> bool:
        return capability in self.capabilities


def key_access(key: ApiKey) -> Access:
    capabilities: frozenset[Capability] = frozenset()
    for scope in key.scopes:
        capabilities |= SCOPE_CAPABILITIES.get(scope, frozenset())
    return Access(tenant=key.tenant, actor=Actor(key=key), role=None, capabilities=capabilities)


def member_access(user: AbstractBaseUser, tenant: Tenant, role: str) -> Access:
    return Access(tenant=tenant, actor=Actor(user=user), role=role, capabilities=ROLE_CAPABILITIES[role])
