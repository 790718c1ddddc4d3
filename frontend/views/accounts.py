"""Pages a person reaches from a mail: accepting an invitation (`/invitations/<token>/`) and resetting a
password (Django's views, with MinT's templates and a limit on how many mails one can ask for)."""

from __future__ import annotations

from functools import cache

from django import forms
from django.conf import settings
from django.contrib import messages
from django.contrib.auth import login, password_validation
from django.contrib.auth import views as auth_views
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.urls import reverse, reverse_lazy
from limits import RateLimitItemPerMinute
from limits.errors import StorageError
from limits.storage import RedisStorage
from limits.strategies import FixedWindowRateLimiter
from redis.exceptions import RedisError

from frontend.forms import form_errors
from mint_site.errors import MintError
from tenants import invitation_links, members
from tenants.auth import SESSION_TENANT_KEY
from tenants.models import Invitation

PASSWORD_BACKEND = "django.contrib.auth.backends.ModelBackend"
RESET_WINDOW_S = 60
RESET_KEY_PREFIX = "mint:pwreset"  # Redis keys of the reset-mail counts


class NewAccountForm(forms.Form):
    username = forms.RegexField(
        label="Username",
        max_length=150,
        regex=r"^[\w.@+-]+$",
        help_text="Letters, digits and @ . + - _ only.",
        error_messages={"invalid": "Use letters, digits and @ . + - _ only."},
    )
    password1 = forms.CharField(label="Password", strip=False, widget=forms.PasswordInput, max_length=1024)
    password2 = forms.CharField(label="Password again", strip=False, widget=forms.PasswordInput, max_length=1024)

    def __init__(self, *args, email: str = "", **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.email = email

    def clean(self) -> dict:
        data = super().clean()
        first, second = data.get("password1"), data.get("password2")
        if first and second and first != second:
            self.add_error("password2", "The two passwords differ.")
        elif first and data.get("username"):
            from django.contrib.auth import get_user_model

            candidate = get_user_model()(username=data["username"], email=self.email)
            try:
                password_validation.validate_password(first, candidate)
            except forms.ValidationError as exc:
                self.add_error("password1", exc)
        return data


def _invitation_page(request: HttpRequest, invitation: Invitation | None, **context) -> HttpResponse:
    status = 404 if invitation is None else 200
    return render(request, "frontend/invitation.html", {"invitation": invitation, **context}, status=status)


def invitation(request: HttpRequest, token: str) -> HttpResponse:
    """See an invitation and accept it: signed in as the person invited, or by making an account (an invitation by
    email to an address no account has). Works once; the page says why when it cannot be used."""
    found = invitation_links.invitation_by_token(token)
    if found is None:
        return _invitation_page(request, None)
    user = request.user if request.user.is_authenticated else None
    problem = members.invitation_problem(found, user=user)
    form = NewAccountForm(email=found.email) if user is None and problem is None else None
    if request.method == "POST" and problem is None:
        try:
            if user is not None:
                members.invitation_accept(invitation=found, user=user)
            else:
                form = NewAccountForm(request.POST, email=found.email)
                if not form.is_valid():
                    messages.error(request, form_errors(form))
                    return _invitation_page(request, found, form=form, problem=None)
                user = members.invitation_accept_new_account(
                    invitation=found, username=form.cleaned_data["username"], password=form.cleaned_data["password1"]
                )
                login(request, user, backend=PASSWORD_BACKEND)
        except MintError as exc:
            messages.error(request, exc.message)
            return _invitation_page(request, found, form=form, problem=None)
        request.session[SESSION_TENANT_KEY] = found.tenant.slug
        messages.success(request, f"Welcome to {found.tenant.name}: you are {found.role} here.")
        return redirect("frontend:overview")
    sign_in = f"{reverse('frontend:login')}?next={request.path}"
    return _invitation_page(request, found, form=form, problem=problem, sign_in=sign_in)


# ---------------------------------------------------------------- password reset


@cache
def _reset_limiter(redis_url: str) -> FixedWindowRateLimiter:
    storage = RedisStorage(
        redis_url, key_prefix=RESET_KEY_PREFIX, wrap_exceptions=True, socket_timeout=0.5, socket_connect_timeout=0.5
    )
    return FixedWindowRateLimiter(storage)


def reset_allowed(*, address: str, email: str) -> bool:
    """Count one reset mail asked from `address` for `email`; False past MINT_PASSWORD_RESETS_PER_MIN for either
    (a mail bomb of someone's inbox, or of many). Redis down: allowed (the mail server still has its limits)."""
    item = RateLimitItemPerMinute(settings.MINT_PASSWORD_RESETS_PER_MIN)
    try:
        limiter = _reset_limiter(settings.REDIS_URL)
        return limiter.hit(item, "address", address or "-") and limiter.hit(item, "email", email.lower())
    except (StorageError, RedisError, OSError):
        return True


class PasswordResetView(auth_views.PasswordResetView):
    template_name = "frontend/password_reset.html"
    email_template_name = "frontend/mail/password_reset.txt"
    subject_template_name = "frontend/mail/password_reset_subject.txt"
    success_url = reverse_lazy("frontend:password-reset-sent")

    def form_valid(self, form) -> HttpResponse:
        if not reset_allowed(address=self.request.META.get("REMOTE_ADDR", ""), email=form.cleaned_data["email"]):
            response = render(
                self.request,
                "frontend/password_reset.html",
                {"form": form, "refused": f"Too many reset mails asked for; try again in {RESET_WINDOW_S} seconds."},
                status=429,
            )
            response["Retry-After"] = str(RESET_WINDOW_S)
            return response
        self.extra_email_context = {"site_url": invitation_links.site_url_of(self.request)}
        return super().form_valid(form)


class PasswordResetSentView(auth_views.PasswordResetDoneView):
    template_name = "frontend/password_reset_sent.html"


class PasswordResetConfirmView(auth_views.PasswordResetConfirmView):
    template_name = "frontend/password_reset_confirm.html"
    success_url = reverse_lazy("frontend:password-reset-done")


class PasswordResetDoneView(auth_views.PasswordResetCompleteView):
    template_name = "frontend/password_reset_done.html"
