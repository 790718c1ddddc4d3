"""Tenants and users by name, for the mint_* management commands, the demo and the benchmarks."""

from __future__ import annotations

from django.contrib.auth import get_user_model
from django.core.management.base import CommandError

from tenants.models import Tenant


def get_tenant(slug: str) -> Tenant:
    tenant = Tenant.objects.filter(slug=slug).first()
    if tenant is None:
        raise CommandError(f"No tenant {slug!r}. Create it with: manage.py mint_tenant create {slug} --owner <user>")
    return tenant


def get_or_create_user(username: str, password: str | None = None):
    """The user named `username`, created (with `password`, or unusable) when missing. Returns (user, created)."""
    User = get_user_model()
    user = User.objects.filter(username=username).first()
    if user is not None:
        return user, False
    user = User(username=username)
    if password:
        user.set_password(password)
    else:
        user.set_unusable_password()
    user.save()
    return user, True


def get_user(username: str):
    user = get_user_model().objects.filter(username=username).first()
    if user is None:
        raise CommandError(f"No user {username!r}.")
    return user
