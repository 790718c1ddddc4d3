"""Forms of the dashboard. Each one only parses input; the services decide and check.

Every field has the label a person reads on the page, and errors name fields by that label
(`form_errors`), never by the field's code name.
"""

from __future__ import annotations

from django import forms
from django.utils import timezone

from adapters.selectors import adapter_search_term
from adapters.serializers import ALIAS_NAME
from mint_site.errors import MintError
from mint_site.names import ADAPTER_NAME_MAX
from tenants.models import Role, Scope

REVISION_STATE_CHOICES = [
    ("", "any state"),
    ("registered", "Registered (validating)"),
    ("validated", "Validated (exporting)"),
    ("exported", "Exported"),
    ("pending_approval", "Pending approval"),
    ("approved", "Approved"),
    ("rejected", "Rejected"),
    ("failed", "Failed"),
]
ADAPTER_STATE_CHOICES = [
    ("", "any"),
    ("serving", "Serving (something live)"),
    ("flipping", "Activation pending"),
    ("awaiting", "Awaiting a decision"),
    ("inactive", "Nothing activated"),
]


def form_errors(form: forms.Form) -> str:
    """The form's errors as one sentence per field, each named by its label ("Training step: Enter a whole number.")."""
    lines = []
    for name, errors in form.errors.items():
        text = " ".join(str(e) for e in errors)
        if name == forms.forms.NON_FIELD_ERRORS:
            lines.append(text)
        else:
            label = form.fields[name].label or name.replace("_", " ").capitalize()
            lines.append(f"{label}: {text}")
    return " ".join(lines) or "The form is not valid."


def _alias_field(*, required: bool = True) -> forms.RegexField:
    return forms.RegexField(
        ALIAS_NAME,
        label="Alias",
        max_length=32,
        required=required,
        error_messages={"invalid": "Lower-case letters, digits, - and _, starting with a letter (at most 32)."},
    )


class DecisionForm(forms.Form):
    comment = forms.CharField(label="Comment", required=False, max_length=2000, widget=forms.TextInput)
    override_reason = forms.CharField(label="Override reason", required=False, max_length=2000)


class EvaluationPolicyForm(forms.Form):
    min_score = forms.FloatField(label="Minimum score", min_value=0.0, max_value=1.0, required=False)
    no_regression = forms.BooleanField(label="No regression", required=False)


class RejectForm(forms.Form):
    comment = forms.CharField(
        label="Reason",
        max_length=2000,
        widget=forms.TextInput,
        error_messages={"required": "Say why the revision is rejected; the registrant reads it."},
    )


class ActivateForm(forms.Form):
    revision = forms.IntegerField(label="Revision", min_value=1)
    canary_percent = forms.IntegerField(label="Canary percent", min_value=1, max_value=50, required=False)
    alias = _alias_field(required=False)


class CanaryForm(forms.Form):
    alias = _alias_field()
    reason = forms.CharField(label="Reason", max_length=500, required=False)


class RollbackForm(forms.Form):
    revision = forms.IntegerField(label="Revision", min_value=1, required=False)
    alias = _alias_field(required=False)


class CancelForm(forms.Form):
    alias = _alias_field()


class RegisterForm(forms.Form):
    files = forms.FileField(label="Adapter files", required=False)  # several, read with request.FILES.getlist
    archive = forms.FileField(label="Archive", required=False)
    training_step = forms.IntegerField(label="Training step", min_value=0, required=False)
    allow_duplicate = forms.BooleanField(label="Register even if identical", required=False)


class ApiKeyCreateForm(forms.Form):
    name = forms.CharField(label="Name", max_length=100)
    scopes = forms.MultipleChoiceField(label="Scopes", choices=Scope.choices, widget=forms.CheckboxSelectMultiple)
    expires_at = forms.DateTimeField(
        label="Expires",
        required=False,
        widget=forms.DateTimeInput(attrs={"type": "datetime-local"}),
        help_text="UTC; leave empty for a key that never expires.",
    )

    adapters = forms.CharField(
        label="Adapters it may call",
        required=False,
        max_length=8000,
        help_text="Comma-separated adapter names; leave empty for all of the tenant's.",
    )
    max_tokens_per_minute = forms.IntegerField(
        label="Tokens per minute", required=False, min_value=1, help_text="Its own limit within the tenant's; optional."
    )
    monthly_token_budget = forms.IntegerField(
        label="Monthly token budget",
        required=False,
        min_value=1,
        help_text="Its own budget within the tenant's; optional.",
    )

    def clean_adapters(self) -> list[str]:
        return [name.strip() for name in self.cleaned_data.get("adapters", "").split(",") if name.strip()]

    def clean_expires_at(self):
        expires_at = self.cleaned_data.get("expires_at")
        if expires_at is not None and expires_at <= timezone.now():
            raise forms.ValidationError("Choose a moment in the future (UTC), or leave it empty.")
        return expires_at


class RevisionFilterForm(forms.Form):
    state = forms.ChoiceField(label="State", choices=REVISION_STATE_CHOICES, required=False)


class AdapterFilterForm(forms.Form):
    """The overview's search (a part of the name, a state) and its page: the ids the page starts below or ends
    above (the page links carry them)."""

    CURSOR_ERRORS = {k: "not a page of this list; follow the page links as they are." for k in ("invalid", "min_value")}

    q = forms.CharField(label="Name contains", max_length=ADAPTER_NAME_MAX, required=False)
    state = forms.ChoiceField(label="State", choices=ADAPTER_STATE_CHOICES, required=False)
    after = forms.IntegerField(
        label="Page after", required=False, min_value=1, max_value=2**63 - 1, error_messages=CURSOR_ERRORS
    )
    before = forms.IntegerField(
        label="Page before", required=False, min_value=1, max_value=2**63 - 1, error_messages=CURSOR_ERRORS
    )

    def clean_q(self) -> str:
        try:
            return adapter_search_term(self.cleaned_data["q"])  # the API's rule (400 `invalid_search` there)
        except MintError as exc:
            raise forms.ValidationError(exc.message.removeprefix("q: ")) from exc

    def clean(self):
        data = super().clean()
        if data.get("after") and data.get("before"):
            raise forms.ValidationError("A page starts after one adapter or ends before one, not both.")
        return data


class AuditFilterForm(forms.Form):
    action = forms.CharField(label="Action", required=False, max_length=64)
    target = forms.CharField(label="Target contains", required=False, max_length=200)
    actor = forms.CharField(label="Actor contains", required=False, max_length=200)
    since = forms.DateField(label="From (UTC)", required=False, widget=forms.DateInput(attrs={"type": "date"}))
    until = forms.DateField(label="To (UTC, inclusive)", required=False, widget=forms.DateInput(attrs={"type": "date"}))

    def clean(self):
        data = super().clean()
        since, until = data.get("since"), data.get("until")
        if since and until and since > until:
            raise forms.ValidationError("The “From” date is after the “To” date.")
        return data


USAGE_RANGE_CHOICES = [("hour", "Last hour"), ("day", "Last day"), ("month", "Last 30 days")]
USAGE_KIND_CHOICES = [
    ("inference", "Applications (inference)"),
    ("sampling", "Training pipelines (sampling)"),
    ("evaluation", "Evaluations (your suites on the nodes)"),
]


class UsageFilterForm(forms.Form):
    """The usage page's switches: the range, and one adapter or the whole tenant (the view checks the name)."""

    range = forms.ChoiceField(label="Range", choices=USAGE_RANGE_CHOICES, required=False)
    adapter = forms.CharField(label="Adapter", max_length=64, required=False)
    # Applications' calls, or training pipelines' samples (billed apart: serving/gateway/sampling.py).
    kind = forms.ChoiceField(label="Traffic", choices=USAGE_KIND_CHOICES, required=False)


class InviteForm(forms.Form):
    who = forms.CharField(
        label="Email or username",
        max_length=254,
        help_text="An email address (the person may have no account yet), or the username of an existing account.",
    )
    role = forms.ChoiceField(label="Role", choices=Role.choices, initial=Role.DEVELOPER)


class MemberRoleForm(forms.Form):
    role = forms.ChoiceField(label="Role", choices=Role.choices)
