"""The one base class every tenant API view inherits.

It resolves the caller's tenant (`TenantPermission`), checks the capability each
HTTP method needs, throttles the caller (per key or person, reads and writes apart, at
the tenant plan's rates: `ApiRateThrottle`), and narrows every queryset to
`request.tenant`, so an object of another tenant is indistinguishable from a missing one (404).
"""

from __future__ import annotations

from django.db.models import Model, QuerySet
from rest_framework import exceptions
from rest_framework.generics import GenericAPIView

from tenants.access import Capability
from tenants.auth import TenantPermission
from tenants.models import Tenant
from tenants.throttles import ApiRateThrottle


class TenantApi(GenericAPIView):
    permission_classes = [TenantPermission]
    # DRF runs throttles after permissions: the throttle reads the tenant and key TenantPermission resolved.
    throttle_classes = [ApiRateThrottle]
    # The capability each method needs. Safe methods default to READ; others must be named.
    capabilities: dict[str, Capability] = {}
    # The lookup from the view's model to its tenant, e.g. "adapter__tenant".
    tenant_field = "tenant"

    def required_capability(self, request) -> Capability:
        method = "GET" if request.method in ("HEAD", "OPTIONS") else request.method
        if method in self.capabilities:
            return self.capabilities[method]
        if method == "GET":
            return Capability.READ
        raise exceptions.MethodNotAllowed(request.method)

    @property
    def tenant(self) -> Tenant:
        return self.request.tenant

    def get_base_queryset(self) -> QuerySet:
        """Subclasses narrow or annotate here; `get_queryset` adds the tenant filter."""
        if self.queryset is None:
            raise NotImplementedError(f"{type(self).__name__} sets no queryset")
        return self.queryset.all()

    def get_queryset(self) -> QuerySet:
        return self.get_base_queryset().filter(**{self.tenant_field: self.request.tenant})

    def get_tenant_object(self, **lookup) -> Model:
        """One object of the caller's tenant, or 404 — the same for missing and for another tenant's."""
        obj = self.get_queryset().filter(**lookup).first()
        if obj is None:
            raise exceptions.NotFound()
        return obj
