"""The tenant's people on the REST API (owners, signed in: keys never manage people, as they never manage keys).

- `GET members/`: members with role and last activity; `GET, PATCH {role}, DELETE members/<username>/`.
- `POST members/<username>/transfer-ownership/ {previous_role?}`: make that member owner; the caller steps down.
- `GET, POST invitations/ {email | username, role}`: pending invitations; invite (the link is mailed);
  `DELETE invitations/<id>/`: revoke.
"""

from __future__ import annotations

from drf_spectacular.utils import OpenApiExample, extend_schema
from rest_framework import exceptions, status
from rest_framework.response import Response

from tenants import invitation_links, members, selectors, services
from tenants.access import Capability
from tenants.api_base import TenantApi
from tenants.models import Invitation, Membership
from tenants.serializers import (
    InvitationCreateSerializer,
    InvitationSerializer,
    MemberRoleSerializer,
    MemberSerializer,
    OwnershipTransferSerializer,
)


class MemberListApi(TenantApi):
    """The tenant's members, by username, with their role and last activity."""

    queryset = Membership.objects.all()
    serializer_class = MemberSerializer
    pagination_class = None
    capabilities = {"GET": Capability.MANAGE_MEMBERS}

    @extend_schema(operation_id="v1_members_list", responses={200: MemberSerializer(many=True)})
    def get(self, request):
        return Response(MemberSerializer(selectors.member_list(tenant=self.tenant), many=True).data)


class MemberDetailApi(TenantApi):
    """One member: read, change the role (`PATCH {role}`), remove (`DELETE`: their keys stop at once)."""

    queryset = Membership.objects.all()
    serializer_class = MemberSerializer
    capabilities = {
        "GET": Capability.MANAGE_MEMBERS,
        "PATCH": Capability.MANAGE_MEMBERS,
        "DELETE": Capability.MANAGE_MEMBERS,
    }

    def member(self, username: str) -> Membership:
        membership = selectors.member_get(tenant=self.tenant, username=username)
        if membership is None:
            raise exceptions.NotFound("No such member in this tenant.")
        return membership

    def get(self, request, username: str):
        found = selectors.member_list(tenant=self.tenant, username=username)
        if not found:
            raise exceptions.NotFound("No such member in this tenant.")
        return Response(MemberSerializer(found[0]).data)

    @extend_schema(request=MemberRoleSerializer, responses={200: MemberSerializer})
    def patch(self, request, username: str):
        membership = self.member(username)
        payload = MemberRoleSerializer(data=request.data)
        payload.is_valid(raise_exception=True)
        changed = members.member_role_change(
            tenant=self.tenant, user=membership.user, role=payload.validated_data["role"], by=request.access.actor
        )
        changed.last_activity = None
        return Response(MemberSerializer(changed).data)

    @extend_schema(responses={204: None})
    def delete(self, request, username: str):
        membership = self.member(username)
        services.membership_remove(tenant=self.tenant, user=membership.user, by=request.access.actor)
        return Response(status=status.HTTP_204_NO_CONTENT)


class OwnershipTransferApi(TenantApi):
    """Make a member the owner; the caller takes `previous_role` (approver unless said otherwise)."""

    queryset = Membership.objects.all()
    serializer_class = MemberSerializer
    capabilities = {"POST": Capability.MANAGE_MEMBERS}

    @extend_schema(request=OwnershipTransferSerializer, responses={200: MemberSerializer})
    def post(self, request, username: str):
        membership = selectors.member_get(tenant=self.tenant, username=username)
        if membership is None:
            raise exceptions.NotFound("No such member in this tenant.")
        payload = OwnershipTransferSerializer(data=request.data)
        payload.is_valid(raise_exception=True)
        owner = members.ownership_transfer(
            tenant=self.tenant,
            to=membership.user,
            by=request.access.actor,
            previous_role=payload.validated_data["previous_role"],
        )
        owner.last_activity = None
        return Response(MemberSerializer(owner).data)


class InvitationListCreateApi(TenantApi):
    """Pending invitations, and inviting someone (the signed link goes to their address, never to the caller)."""

    queryset = Invitation.objects.all()
    serializer_class = InvitationSerializer
    capabilities = {"GET": Capability.MANAGE_MEMBERS, "POST": Capability.MANAGE_MEMBERS}

    def get_base_queryset(self):
        return selectors.invitation_list(tenant=self.tenant)

    def get(self, request):
        page = self.paginate_queryset(self.get_queryset())
        return self.get_paginated_response(InvitationSerializer(page, many=True).data)

    @extend_schema(
        request=InvitationCreateSerializer,
        responses={201: InvitationSerializer},
        examples=[
            OpenApiExample("by email", value={"email": "ada@example.com", "role": "approver"}, request_only=True),
            OpenApiExample("an existing account", value={"username": "grace", "role": "developer"}, request_only=True),
        ],
    )
    def post(self, request):
        payload = InvitationCreateSerializer(data=request.data)
        payload.is_valid(raise_exception=True)
        data = payload.validated_data
        invitation = members.member_invite(
            tenant=self.tenant,
            role=data["role"],
            email=data.get("email", ""),
            username=data.get("username", ""),
            by=request.access.actor,
            site_url=invitation_links.site_url_of(request),
        )
        return Response(InvitationSerializer(invitation).data, status=status.HTTP_201_CREATED)


class InvitationRevokeApi(TenantApi):
    """Revoke a pending invitation: its link stops working."""

    queryset = Invitation.objects.all()
    serializer_class = InvitationSerializer
    capabilities = {"DELETE": Capability.MANAGE_MEMBERS}

    @extend_schema(responses={204: None})
    def delete(self, request, invitation_id: int):
        invitation = self.get_tenant_object(id=invitation_id)
        members.invitation_revoke(invitation=invitation, by=request.access.actor)
        return Response(status=status.HTTP_204_NO_CONTENT)
