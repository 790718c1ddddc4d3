from django.urls import path

from tenants import apis, member_apis, session_apis

urlpatterns = [
    path("", apis.WhoAmIApi.as_view(), name="api-root"),
    path("session/", session_apis.SessionApi.as_view(), name="api-session"),
    path("keys/", apis.ApiKeyListCreateApi.as_view(), name="api-keys"),
    path("keys/<str:prefix>/", apis.ApiKeyRevokeApi.as_view(), name="api-key-detail"),
    path("audit/", apis.AuditEventListApi.as_view(), name="audit-events"),
    path("members/", member_apis.MemberListApi.as_view(), name="api-members"),
    path("members/<str:username>/", member_apis.MemberDetailApi.as_view(), name="api-member-detail"),
    path(
        "members/<str:username>/transfer-ownership/",
        member_apis.OwnershipTransferApi.as_view(),
        name="api-member-transfer",
    ),
    path("invitations/", member_apis.InvitationListCreateApi.as_view(), name="api-invitations"),
    path("invitations/<int:invitation_id>/", member_apis.InvitationRevokeApi.as_view(), name="api-invitation-detail"),
]
