"""Sign a person in and out of the REST API: `POST /api/v1/session/` and `DELETE /api/v1/session/`.

This is how a person's tools (the `mint login` command) get what a key never has: a session, which manages
API keys (`/api/v1/keys/`, owners only; keys never manage keys). It is the one API view that is not a
`TenantApi`: before sign-in there is no tenant to narrow anything to, and it shows the person nothing but
their own memberships.

- The password goes through `django.contrib.auth.authenticate()` with the request, so django-axes counts a
  wrong one against the username and client address exactly as at `/login/` (MINT_LOGIN_FAILURE_LIMIT,
  MINT_LOGIN_COOLOFF_S), and refuses a locked-out pair before any password is checked.
- Only JSON is parsed: a cross-site page cannot send `application/json` without a CORS preflight, which MinT
  never grants, so no other site can sign a browser in (login CSRF). Once signed in, every unsafe request on
  the session (this DELETE included) needs the CSRF token: DRF's session authentication checks it.
- A request with an `Authorization` header is refused: a key (or anything posing as one) never turns into a
  person's session.
"""

from __future__ import annotations

import math
from datetime import timedelta

from axes.helpers import get_cool_off
from django.contrib.auth import authenticate, get_user_model, login, logout
from django.middleware.csrf import get_token
from drf_spectacular.utils import extend_schema
from rest_framework import exceptions, serializers, status
from rest_framework.parsers import JSONParser
from rest_framework.permissions import AllowAny
from rest_framework.response import Response
from rest_framework.views import APIView

from mint_site.errors import MintError
from tenants import selectors
from tenants.auth import SESSION_TENANT_KEY, TenantSessionAuthentication

# PBKDF2 costs the same for any length (HMAC hashes a long key first); the bound keeps refusals cheap to read.
PASSWORD_MAX_LENGTH = 1024
USERNAME_MAX_LENGTH = get_user_model()._meta.get_field(get_user_model().USERNAME_FIELD).max_length or 150


class InvalidCredentials(MintError):
    status_code = status.HTTP_401_UNAUTHORIZED
    code = "invalid_credentials"


class KeyCannotSignIn(MintError):
    status_code = status.HTTP_403_FORBIDDEN
    code = "api_key_cannot_sign_in"


class LoginLockedOut(MintError):
    status_code = status.HTTP_429_TOO_MANY_REQUESTS
    code = "login_locked_out"


class SessionCreateSerializer(serializers.Serializer):
    username = serializers.CharField(max_length=USERNAME_MAX_LENGTH, trim_whitespace=False)
    password = serializers.CharField(max_length=PASSWORD_MAX_LENGTH, trim_whitespace=False)
    tenant = serializers.SlugField(
        max_length=63,
        required=False,
        allow_blank=True,
        help_text="The tenant the session acts for (a person in several names one; one tenant: that one).",
    )


class SessionTenantSerializer(serializers.Serializer):
    slug = serializers.CharField()
    name = serializers.CharField()
    role = serializers.CharField()


class SessionSerializer(serializers.Serializer):
    user = serializers.CharField()
    tenant = serializers.CharField(
        allow_null=True,
        help_text="The tenant the session acts for; null when the person is in several and named none "
        "(send X-Mint-Tenant then).",
    )
    tenants = SessionTenantSerializer(many=True)
    csrf_token = serializers.CharField(
        help_text="Send it as X-CSRFToken (with an Origin header of MinT's own origin) on every unsafe request."
    )


class SessionApi(APIView):
    """A person's session for the REST API: sign in (POST) with a password, sign out (DELETE)."""

    authentication_classes = [TenantSessionAuthentication]
    permission_classes = [AllowAny]
    parser_classes = [JSONParser]
    throttle_classes: list = []  # django-axes throttles sign-in per username and client address

    # No credential but the body's password (`{}`: none); the session afterwards is `TenantSession`.
    @extend_schema(request=SessionCreateSerializer, responses={200: SessionSerializer}, auth=[{}])
    def post(self, request):
        if request.META.get("HTTP_AUTHORIZATION"):
            raise KeyCannotSignIn(
                "An API key cannot start a session (keys never manage keys). Sign in with a person's username "
                "and password, without an Authorization header."
            )
        payload = SessionCreateSerializer(data=request.data)
        payload.is_valid(raise_exception=True)
        data = payload.validated_data
        http_request = request._request  # django-axes flags the Django request, which its middleware reads
        user = authenticate(http_request, username=data["username"], password=data["password"])
        if getattr(http_request, "axes_locked_out", False):
            # Answered here in the API's error shape; the flag would have AxesMiddleware swap this answer for
            # the dashboard's HTML lockout page.
            http_request.axes_locked_out = False
            retry_after = max(1, math.ceil((get_cool_off(http_request) or timedelta(0)).total_seconds()))
            raise LoginLockedOut(
                f"Too many failed sign-ins for {data['username']!r} from this address; try again in "
                f"{math.ceil(retry_after / 60)} minute(s).",
                detail={"retry_after": retry_after},
                headers={"Retry-After": str(retry_after)},
            )
        if user is None:
            raise InvalidCredentials(
                "The username or password is not right.", headers={"WWW-Authenticate": 'Session realm="mint"'}
            )
        choice = selectors.choose_tenant(user=user, named=data.get("tenant") or None)
        if choice.problem == "not_member":
            # The same answer whether the tenant exists or not; nobody is signed in.
            raise exceptions.NotFound(f"No tenant {choice.named!r} among yours.", code="tenant_not_found")
        login(http_request, user)  # a new session key (no fixation) and a new CSRF token
        if choice.membership is not None:
            request.session[SESSION_TENANT_KEY] = choice.membership.tenant.slug
        body = {
            "user": user.get_username(),
            "tenant": choice.membership.tenant.slug if choice.membership is not None else None,
            "tenants": [{"slug": m.tenant.slug, "name": m.tenant.name, "role": m.role} for m in choice.memberships],
            "csrf_token": get_token(http_request),
        }
        return Response(SessionSerializer(body).data)

    @extend_schema(request=None, responses={204: None}, auth=[{"TenantSession": []}, {}])
    def delete(self, request):
        logout(request._request)
        return Response(status=status.HTTP_204_NO_CONTENT)
