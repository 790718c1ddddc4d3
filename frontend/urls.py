"""Dashboard routes, mounted at the site root (the API stays under /api/ and /v1/)."""

from django.urls import include, path

from frontend import apis
from frontend.views import accounts, actions, auth, keys, lifecycle, members, pages, sso, webhooks

app_name = "frontend"

# An adapter's pages and forms, below adapters/<name>/; the rest of its life is in frontend/views/lifecycle.py.
adapter_patterns = [
    path("", pages.adapter_detail, name="adapter"),
    path("edit/", lifecycle.adapter_edit, name="adapter-edit"),
    path("retention/", lifecycle.adapter_retention, name="adapter-retention"),
    path("delete/", lifecycle.adapter_delete, name="adapter-delete"),
    path("deactivate/", lifecycle.alias_deactivate, name="deactivate"),
    path("diff/", lifecycle.adapter_diff, name="diff"),
    path("register/", actions.revision_register, name="register"),
    path("activate/", actions.adapter_activate, name="activate"),
    path("rollback/", actions.adapter_rollback, name="rollback"),
    path("cancel/", actions.activation_cancel, name="cancel"),
    path("evaluation-suite/", actions.suite_upload, name="suite-upload"),
    path("evaluation-policy/", actions.evaluation_policy, name="evaluation-policy"),
    path("promote/", actions.canary_promote, name="canary-promote"),
    path("abort/", actions.canary_abort, name="canary-abort"),
    path("revisions/<int:number>/", pages.adapter_detail, name="revision"),
    path("revisions/<int:number>/archive/", lifecycle.revision_archive, name="archive"),
    path("revisions/<int:number>/restore/", lifecycle.revision_restore, name="restore"),
    path("revisions/<int:number>/keep/", lifecycle.revision_keep, name="keep"),
    path("revisions/<int:number>/playground/", lifecycle.revision_playground, name="playground"),
    path("revisions/<int:number>/files/<str:filename>", lifecycle.revision_download, name="download"),
    path("revisions/<int:number>/approve/", actions.revision_decide, {"decision": "approve"}, name="approve"),
    path("revisions/<int:number>/reject/", actions.revision_decide, {"decision": "reject"}, name="reject"),
    path("revisions/<int:number>/retry/", actions.revision_retry, name="retry"),
    path("revisions/<int:number>/request-approval/", actions.revision_request_approval, name="request-approval"),
]

urlpatterns = [
    path("", pages.overview, name="overview"),
    path("login/", auth.LoginView.as_view(), name="login"),
    path("logout/", auth.LogoutView.as_view(), name="logout"),
    path("tenant/", auth.tenant_switch, name="tenant-switch"),
    path("password-reset/", accounts.PasswordResetView.as_view(), name="password-reset"),
    path("password-reset/sent/", accounts.PasswordResetSentView.as_view(), name="password-reset-sent"),
    path(
        "password-reset/<uidb64>/<token>/",
        accounts.PasswordResetConfirmView.as_view(),
        name="password-reset-confirm",
    ),
    path("password-reset/done/", accounts.PasswordResetDoneView.as_view(), name="password-reset-done"),
    path("invitations/<str:token>/", accounts.invitation, name="invitation"),
    path("sso/", sso.sso_choose, name="sso"),
    path("sso/callback/", sso.SsoCallbackView.as_view(), name="sso-callback"),
    path("sso/<slug:slug>/", sso.SsoStartView.as_view(), name="sso-start"),
    path("members/", members.member_list, name="members"),
    path("members/<str:username>/role/", members.member_role, name="member-role"),
    path("members/<str:username>/remove/", members.member_remove, name="member-remove"),
    path("members/<str:username>/transfer/", members.member_transfer, name="member-transfer"),
    path("invitations/<int:invitation_id>/revoke/", members.invitation_revoke, name="invitation-revoke"),
    path("settings/", members.tenant_settings, name="settings"),
    path("settings/sso/", members.sso_policy, name="sso-policy"),
    # The caller's tenant and its plan on the REST API; here because it reads every app's counts.
    path("api/v1/tenant/", apis.TenantPlanApi.as_view(), name="api-tenant"),
    path("nodes/", pages.nodes, name="nodes"),
    path("nodes/<str:name>/drain/", actions.node_drain, name="node-drain"),
    path("nodes/<str:name>/undrain/", actions.node_undrain, name="node-undrain"),
    path("audit/", pages.audit, name="audit"),
    path("audit/export.csv", pages.audit_export, name="audit-export"),
    path("usage/", pages.usage, name="usage"),
    path("usage/export.csv", pages.usage_export, name="usage-export"),
    path("keys/", keys.api_keys, name="keys"),
    path("keys/<str:prefix>/revoke/", keys.api_key_revoke, name="key-revoke"),
    path("webhooks/", webhooks.webhooks, name="webhooks"),
    path("webhooks/<int:webhook_id>/ping/", webhooks.webhook_ping, name="webhook-ping"),
    path("webhooks/<int:webhook_id>/delete/", webhooks.webhook_delete, name="webhook-delete"),
    path(
        "webhooks/<int:webhook_id>/deliveries/<int:delivery_id>/redeliver/",
        webhooks.webhook_redeliver,
        name="webhook-redeliver",
    ),
    path("create-adapter/", lifecycle.adapter_create, name="adapter-create"),
    path("adapters/<str:name>/", include(adapter_patterns)),
]
