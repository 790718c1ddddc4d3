"""The Django admin for platform staff.

Every change it makes to a tenant or its members goes through the services (`tenant_update`,
`membership_set`, `membership_remove`), so it is checked and audited like the same change made
anywhere else: the admin's forms only collect what was asked for.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django import forms
from django.contrib import admin, messages
from django.contrib.auth.models import AbstractBaseUser
from django.db import models, transaction
from django.db.models import QuerySet
from django.forms import BaseModelFormSet, ModelForm
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect

from mint_site.errors import MintError
from tenants import members, services
from tenants.access import Actor
from tenants.models import ApiKey, AuditEvent, IdentityProvider, Membership, Role, Tenant


class ServiceRefusalsAsMessages:
    """Admin mixin: when a service refuses a change (say, removing a tenant's last owner), the whole request is
    undone and the page comes back with the reason as an error message, instead of a server error."""

    def changeform_view(self, request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        return self._refusals_as_messages(request, super().changeform_view, *args, **kwargs)

    def delete_view(self, request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        return self._refusals_as_messages(request, super().delete_view, *args, **kwargs)

    def changelist_view(self, request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        # Bulk actions (delete selected) run from here: all of the selection changes, or none of it.
        return self._refusals_as_messages(request, super().changelist_view, *args, **kwargs)

    def _refusals_as_messages(self, request: HttpRequest, view: Callable[..., HttpResponse], *args, **kwargs):
        try:
            # The admin's own log entries are written in here too, so a refusal leaves none behind.
            with transaction.atomic():
                return view(request, *args, **kwargs)
        except MintError as exc:
            self.message_user(request, f"Nothing was changed: {exc.message}", messages.ERROR)
            return HttpResponseRedirect(request.get_full_path())


# Single sign-on: the issuer a tenant's people sign in with, and who joins through it (tenants/sso.py).
SSO_FIELDS = ("sso_provider", "sso_join", "sso_default_role")


class MembershipInline(admin.TabularInline):
    """A tenant's members on its page. Saved by `TenantAdmin.save_formset` through the membership services."""

    model = Membership
    extra = 0
    autocomplete_fields = ["user"]
    fields = ["user", "role", "created_at"]
    readonly_fields = ["created_at"]


@admin.register(Tenant)
class TenantAdmin(ServiceRefusalsAsMessages, admin.ModelAdmin):
    """Plan limits, switches and members of a tenant; every change is audited.

    Tenants are created with `mint_tenant create <slug> --owner <username>` (which names the first owner and
    records it), and retired by clearing "is active": deleting one here would take its keys, members and
    audit trail with it, unrecorded.
    """

    list_display = ["slug", "name", "is_active", "max_adapters", "rate_limit_rpm", "four_eyes", "created_at"]
    search_fields = ["slug", "name"]
    list_filter = ["is_active", "four_eyes"]
    inlines = [MembershipInline]
    fields = ["slug", *services.TENANT_UPDATABLE_FIELDS, *SSO_FIELDS, "created_at"]
    readonly_fields = ["slug", "created_at"]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Tenant | None = None) -> bool:
        return False

    def formfield_for_dbfield(self, db_field, request: HttpRequest, **kwargs: Any):
        if db_field.name == "sso_default_role":
            return forms.ChoiceField(
                choices=[(r, r) for r in members.SSO_DEFAULT_ROLES], label="SSO default role", required=True
            )
        return super().formfield_for_dbfield(db_field, request, **kwargs)

    def save_model(self, request: HttpRequest, obj: Tenant, form: ModelForm, change: bool) -> None:
        # `obj` already carries the form's values; tenant_update reads the stored ones for the audit's "before".
        changes = {name: form.cleaned_data[name] for name in form.changed_data if name not in SSO_FIELDS}
        by = Actor(user=request.user)
        services.tenant_update(tenant=obj, changes=changes, by=by)
        sso = {name: form.cleaned_data[name] for name in form.changed_data if name in SSO_FIELDS}
        if sso:
            members.tenant_sso_update(
                tenant=obj,
                by=by,
                **({"provider": sso["sso_provider"]} if "sso_provider" in sso else {}),
                join=sso.get("sso_join"),
                default_role=sso.get("sso_default_role"),
            )

    def save_formset(self, request: HttpRequest, form: ModelForm, formset: BaseModelFormSet, change: bool) -> None:
        if formset.model is not Membership:
            super().save_formset(request, form, formset, change)
            return
        _save_memberships(tenant=form.instance, formset=formset, by=Actor(user=request.user))


def _save_memberships(*, tenant: Tenant, formset: BaseModelFormSet, by: Actor) -> None:
    """Apply the inline's additions, role changes and removals through the membership services.

    Promotions to owner go first and removals last, so handing ownership from one person to another in one
    save never passes, in between, through a tenant without an owner (which the services refuse).
    """
    # The forms' instances already hold the submitted values: what each row was comes from the database.
    originals = {m.pk: m for m in Membership.objects.filter(tenant=tenant).select_related("user")}
    deleted = set(map(id, formset.deleted_forms))
    wanted: list[tuple[AbstractBaseUser, str]] = []
    leaving: list[Membership] = []
    for row in formset.forms:
        original = originals.get(row.instance.pk) if row.instance.pk is not None else None
        if id(row) in deleted:
            if original is not None:
                leaving.append(original)
            continue
        if not row.has_changed():
            continue
        user, role = row.cleaned_data["user"], row.cleaned_data["role"]
        if original is not None and original.user_id != user.pk:
            leaving.append(original)  # the row now names someone else: the person it named leaves
        if original is None or original.user_id != user.pk or original.role != role:
            wanted.append((user, role))

    already_members = {m.user_id for m in originals.values()}
    new_objects: list[Membership] = []
    changed_objects: list[tuple[Membership, list[str]]] = []
    for user, role in sorted(wanted, key=lambda pair: pair[1] != Role.OWNER):
        membership = services.membership_set(tenant=tenant, user=user, role=role, by=by)
        if user.pk in already_members:
            changed_objects.append((membership, ["role"]))
        else:
            new_objects.append(membership)
    staying = {user.pk for user, _ in wanted}
    deleted_objects = []
    for membership in leaving:
        if membership.user_id not in staying:
            services.membership_remove(tenant=tenant, user=membership.user, by=by)
            deleted_objects.append(membership)
    # What the admin's change message and history entry list (formset.save() would have set these).
    formset.new_objects, formset.changed_objects, formset.deleted_objects = (
        new_objects,
        changed_objects,
        deleted_objects,
    )


@admin.register(Membership)
class MembershipAdmin(ServiceRefusalsAsMessages, admin.ModelAdmin):
    """Members of every tenant. Adding, changing a role and removing go through the membership services.

    Who and which tenant are fixed once the membership exists: moving it would be a removal and an
    addition, so it is done as those.
    """

    list_display = ["user", "tenant", "role", "created_at"]
    list_filter = ["role"]
    search_fields = ["user__username", "tenant__slug"]
    autocomplete_fields = ["user", "tenant"]
    fields = ["user", "tenant", "role", "created_at"]

    def get_readonly_fields(self, request: HttpRequest, obj: Membership | None = None) -> list[str]:
        return ["created_at"] if obj is None else ["user", "tenant", "created_at"]

    def save_model(self, request: HttpRequest, obj: Membership, form: ModelForm, change: bool) -> None:
        saved = services.membership_set(tenant=obj.tenant, user=obj.user, role=obj.role, by=Actor(user=request.user))
        # The admin's history entry and redirect name the row the service saved.
        obj.pk, obj.created_at = saved.pk, saved.created_at
        obj._state.adding = False

    def delete_model(self, request: HttpRequest, obj: Membership) -> None:
        services.membership_remove(tenant=obj.tenant, user=obj.user, by=Actor(user=request.user))

    def delete_queryset(self, request: HttpRequest, queryset: QuerySet[Membership]) -> None:
        by = Actor(user=request.user)
        for membership in queryset.select_related("tenant", "user").order_by("id"):
            services.membership_remove(tenant=membership.tenant, user=membership.user, by=by)


@admin.register(ApiKey)
class ApiKeyAdmin(admin.ModelAdmin):
    """Keys are created with `mint_key create` or the API (the token is shown once); here they are read and revoked."""

    list_display = [
        "prefix",
        "tenant",
        "name",
        "scopes",
        "created_by",
        "created_at",
        "last_used_at",
        "expires_at",
        "revoked_at",
    ]
    search_fields = ["prefix", "name", "tenant__slug"]
    list_filter = ["tenant"]
    readonly_fields = [
        "tenant",
        "prefix",
        "key_hash",
        "scopes",
        "created_by",
        "created_at",
        "last_used_at",
        "expires_at",
        "revoked_at",
        "adapters",
        "max_tokens_per_minute",
        "monthly_token_budget",
    ]
    fields = ["name", *readonly_fields]
    actions = ["revoke"]

    def has_add_permission(self, request) -> bool:
        return False

    @admin.action(description="Revoke the selected keys")
    def revoke(self, request, queryset) -> None:
        for key in queryset.select_related("tenant"):
            services.api_key_revoke(key=key, by=Actor(user=request.user))
        self.message_user(request, f"Revoked {queryset.count()} key(s).")


@admin.register(AuditEvent)
class AuditEventAdmin(admin.ModelAdmin):
    """Append-only: readable, never changed or deleted here."""

    list_display = ["at", "tenant", "actor", "action", "target"]
    list_filter = ["action", "tenant"]
    search_fields = ["actor", "target", "action"]

    def has_add_permission(self, request) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False

    def has_delete_permission(self, request, obj=None) -> bool:
        return False


@admin.register(IdentityProvider)
class IdentityProviderAdmin(admin.ModelAdmin):
    """OpenID Connect issuers MinT is registered with as a client; bind a tenant to one on the tenant's page."""

    list_display = ["name", "issuer", "client_id"]
    search_fields = ["name", "issuer"]
    fields = [
        "name",
        "issuer",
        "client_id",
        "client_secret",
        "authorization_endpoint",
        "token_endpoint",
        "userinfo_endpoint",
        "jwks_uri",
        "signing_algorithm",
        "scopes",
    ]

    def formfield_for_dbfield(self, db_field, request: HttpRequest, **kwargs: Any):
        if db_field.name == "client_secret":  # shown to nobody once saved; kept when left empty
            kwargs["widget"] = forms.PasswordInput(render_value=False)
            kwargs["required"] = False
        if isinstance(db_field, models.URLField):
            kwargs["assume_scheme"] = "https"  # an issuer's address without a scheme is an https one
        return super().formfield_for_dbfield(db_field, request, **kwargs)

    def save_model(self, request: HttpRequest, obj: IdentityProvider, form: ModelForm, change: bool) -> None:
        if change and not form.cleaned_data.get("client_secret"):
            obj.client_secret = IdentityProvider.objects.get(pk=obj.pk).client_secret
        super().save_model(request, obj, form, change)
