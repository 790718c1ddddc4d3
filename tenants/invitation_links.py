"""The signed links of invitations: `/invitations/<token>/`, where the token names the invitation and its nonce.

Signed with the site's SECRET_KEY (django.core.signing), so nobody can make one up; the nonce ties a link to
one sending of its invitation (sending it again makes a new nonce); the row says whether it is still pending
and until when (tenants/members.py).
"""

from __future__ import annotations

from django.conf import settings
from django.core import signing
from django.urls import reverse
from django.utils.crypto import constant_time_compare

from tenants.models import Invitation

SALT = "mint.invitation"
TOKEN_MAX_LENGTH = 200


def token_of(invitation: Invitation) -> str:
    return signing.dumps({"i": invitation.id, "n": invitation.nonce}, salt=SALT)


def path_of(invitation: Invitation) -> str:
    """The path of the invitation's acceptance page (the dashboard's `frontend:invitation`)."""
    return reverse("frontend:invitation", kwargs={"token": token_of(invitation)})


def invitation_by_token(token: str) -> Invitation | None:
    """The invitation a link names, whatever its state (the page says why it cannot be used); None if the token
    is not one MinT signed, or names a sending of the invitation that was replaced by a newer one."""
    if not token or len(token) > TOKEN_MAX_LENGTH:
        return None
    try:
        data = signing.loads(token, salt=SALT)
    except signing.BadSignature:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("i"), int) or not isinstance(data.get("n"), str):
        return None
    invitation = Invitation.objects.select_related("tenant", "user", "invited_by").filter(id=data["i"]).first()
    if invitation is None or not constant_time_compare(invitation.nonce, data["n"]):
        return None
    return invitation


def site_url_of(request) -> str:
    """The site's address for mailed links: MINT_SITE_URL, else the scheme and host the request came to
    (a host Django accepted: ALLOWED_HOSTS)."""
    return settings.MINT_SITE_URL or request.build_absolute_uri("/").rstrip("/")
