"""Who is calling, for which tenant, and what they may do.

A person acts with the capabilities of their role in the tenant. A key acts with the
capabilities its scopes name, narrowed to what its creator may do there now: a key never
outlives or outranks the person who made it (a key made without a person, by an operator
on the command line, keeps its scopes). Every API view declares the capability each method
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
    MANAGE_WEBHOOKS = "manage_webhooks"  # create, change and delete webhook endpoints; ping, redeliver
    MANAGE_MEMBERS = "manage_members"  # invite people, change roles, remove members, transfer ownership
    INFERENCE = "inference"  # the OpenAI-compatible gateway
    # The gateway too, for a training pipeline's rollouts: any exported revision of the tenant by `adapter@rN`,
    # approved or not (serving/gateway/sampling.py). Approval gates what applications see, not a trainer's reads.
    SAMPLE = "sample"


# Every member may run inference, so that an inference key of any member works; people themselves
# reach the gateway only through a key (it accepts nothing else).
ROLE_CAPABILITIES: dict[str, frozenset[Capability]] = {
    Role.VIEWER: frozenset({Capability.READ, Capability.INFERENCE}),
    Role.DEVELOPER: frozenset({Capability.READ, Capability.REGISTER, Capability.INFERENCE, Capability.SAMPLE}),
    Role.APPROVER: frozenset(
        {Capability.READ, Capability.REGISTER, Capability.DECIDE, Capability.INFERENCE, Capability.SAMPLE}
    ),
    Role.OWNER: frozenset(
        {
            Capability.READ,
            Capability.REGISTER,
            Capability.DECIDE,
            Capability.MANAGE_KEYS,
            Capability.MANAGE_WEBHOOKS,
            Capability.MANAGE_MEMBERS,
            Capability.INFERENCE,
            Capability.SAMPLE,
        }
    ),
}

SCOPE_CAPABILITIES: dict[str, frozenset[Capability]] = {
    Scope.INFERENCE: frozenset({Capability.INFERENCE}),
    Scope.PIPELINE: frozenset({Capability.READ, Capability.REGISTER, Capability.SAMPLE}),
    Scope.DEPLOY: frozenset({Capability.READ, Capability.DECIDE}),
    Scope.SAMPLING: frozenset({Capability.SAMPLE}),
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
        """The person responsible: a key acts as the user who created it (None for a key made without one)."""
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


def scope_capabilities(scopes: list[str] | tuple[str, ...]) -> frozenset[Capability]:
    """What a set of key scopes allows, before the key's creator's role narrows it."""
    capabilities: frozenset[Capability] = frozenset()
    for scope in scopes:
        capabilities |= SCOPE_CAPABILITIES.get(scope, frozenset())
    return capabilities


def key_capabilities(key: ApiKey) -> frozenset[Capability]:
    """What a key may do now: its scopes' capabilities ∩ its creator's current role in the key's tenant.

    Reads `key.creator_role`, the creator's role in the key's tenant now (None: not a member), which
    `selectors.api_key_by_prefix` (and so `tenants.auth.authenticate_token`) annotates in the key's
    own query. A key loaded without it counts as one whose creator has no role: it may do nothing.
    A creator who left the tenant or was deactivated leaves the key with nothing; a key without a
    creator (made by an operator with `mint_key create`) keeps its scopes.
    """
    capabilities = scope_capabilities(key.scopes)
    if key.created_by_id is None:
        return capabilities
    creator_role = getattr(key, "creator_role", None)
    if creator_role is None or not key.created_by.is_active:
        return frozenset()
    return capabilities & ROLE_CAPABILITIES.get(creator_role, frozenset())


def key_access(key: ApiKey) -> Access:
    """A key's access: its tenant, itself as the actor, and `key_capabilities` (see there for what it reads)."""
    return Access(tenant=key.tenant, actor=Actor(key=key), role=None, capabilities=key_capabilities(key))


def member_access(user: AbstractBaseUser, tenant: Tenant, role: str) -> Access:
    return Access(tenant=tenant, actor=Actor(user=user), role=role, capabilities=ROLE_CAPABILITIES[role])
