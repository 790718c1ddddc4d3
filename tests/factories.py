"""factory_boy factories for the suite."""

from __future__ import annotations

import factory
from django.contrib.auth import get_user_model

from serving.models import NodeState, ServingNode
from tenants.models import Membership, Role, Tenant

PASSWORD = "correct-horse-battery"


class UserFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = get_user_model()
        django_get_or_create = ("username",)
        skip_postgeneration_save = True

    username = factory.Sequence(lambda n: f"user{n}")
    password = factory.django.Password(PASSWORD)


class TenantFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Tenant
        django_get_or_create = ("slug",)

    slug = factory.Sequence(lambda n: f"tenant{n}")
    name = factory.LazyAttribute(lambda o: o.slug.title())


class MembershipFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Membership

    user = factory.SubFactory(UserFactory)
    tenant = factory.SubFactory(TenantFactory)
    role = Role.VIEWER


class ServingNodeFactory(factory.django.DjangoModelFactory):
    """A node that is up; pass `base_model`. Its URL and cache directory follow its name."""

    class Meta:
        model = ServingNode

    name = factory.Sequence(lambda n: f"node-{n}")
    url = factory.LazyAttribute(lambda o: f"http://{o.name}.test")
    served_model_name = "tiny"
    state = NodeState.UP
    gpu_slots = 1
    cpu_slots = 2
    cache_dir = factory.LazyAttribute(lambda o: f"/tmp/{o.name}-cache")
