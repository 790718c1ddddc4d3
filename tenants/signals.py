"""Keys follow people, also when people and tenants are changed where no service announces it.

What a key may do depends on its creator's account, membership and tenant (tenants/access.py), and
gateway processes cache authenticated keys, so each change of those is announced with
`services.api_keys_changed` once committed. Memberships change only through their services, which
announce it. People are changed directly (the Django admin's user pages, `createsuperuser`,
`manage.py shell`), and a tenant's state by `tenant_update` or directly: the receivers here compare
the fields that matter with the values the instance was loaded with.

A person who is deleted has their live keys revoked first: the database would otherwise clear the
keys' `created_by`, and a key without a creator acts with its full scopes (an operator's key).
"""

from __future__ import annotations

from typing import Any

from django.contrib.auth import get_user_model
from django.db.models.signals import post_init, post_save, pre_delete

from tenants import selectors, services
from tenants.access import Actor
from tenants.models import Tenant
from tenants.models.tenant import GATEWAY_PLAN_FIELDS

# Fields whose change alters what a key may do or what a gateway caches about it (serving/gateway/auth.py).
_USER_FIELDS = ("is_active",)
_TENANT_FIELDS = ("is_active", "slug", *GATEWAY_PLAN_FIELDS)
_SEEN = "_keys_fields_seen"


def _remember(fields: tuple[str, ...]):
    def remember(sender, instance, **kwargs: Any) -> None:
        # From __dict__: a deferred field is not loaded (that would cost a query per instance); it is not compared.
        setattr(instance, _SEEN, {name: instance.__dict__[name] for name in fields if name in instance.__dict__})

    return remember


def _changed(instance, fields: tuple[str, ...]) -> bool:
    seen = getattr(instance, _SEEN, {})
    now = {name: instance.__dict__[name] for name in fields if name in instance.__dict__}
    setattr(instance, _SEEN, seen | now)
    return any(name in seen and seen[name] != value for name, value in now.items())


def _user_saved(sender, instance, created: bool, **kwargs: Any) -> None:
    """A person deactivated or reactivated: their keys stop (401 api_key_owner_inactive) or work again."""
    if _changed(instance, _USER_FIELDS) and not created:
        for tenant_id in sorted(selectors.tenant_ids_of_person(user=instance)):
            services.api_keys_changed(tenant_id=tenant_id, reason="person")


def _user_deleting(sender, instance, **kwargs: Any) -> None:
    for key in selectors.api_keys_live_created_by(user=instance):
        services.api_key_revoke(key=key, by=Actor.system())


def _tenant_saved(sender, instance: Tenant, created: bool, **kwargs: Any) -> None:
    """A tenant suspended or resumed, or its gateway plan changed: its keys are authenticated again."""
    if _changed(instance, _TENANT_FIELDS) and not created:
        services.api_keys_changed(tenant_id=instance.id, reason="tenant")


def connect() -> None:
    """Connect the receivers (from `TenantsConfig.ready`)."""
    user_model = get_user_model()
    post_init.connect(_remember(_USER_FIELDS), sender=user_model, weak=False, dispatch_uid="tenants.user.seen")
    post_save.connect(_user_saved, sender=user_model, dispatch_uid="tenants.user.saved")
    pre_delete.connect(_user_deleting, sender=user_model, dispatch_uid="tenants.user.deleting")
    post_init.connect(_remember(_TENANT_FIELDS), sender=Tenant, weak=False, dispatch_uid="tenants.tenant.seen")
    post_save.connect(_tenant_saved, sender=Tenant, dispatch_uid="tenants.tenant.saved")
