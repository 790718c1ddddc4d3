"""Forms of the dashboard. Each one only parses input; the services decide and check."""

from __future__ import annotations

from django import forms

from tenants.models import Scope


class DecisionForm(forms.Form):
    comment = forms.CharField(required=False, max_length=2000, widget=forms.TextInput)


class ActivateForm(forms.Form):
    revision = forms.IntegerField(min_value=1)


class RollbackForm(forms.Form):
    revision = forms.IntegerField(min_value=1, required=False)


class RegisterForm(forms.Form):
    files = forms.FileField(required=False)  # several, read with request.FILES.getlist
    archive = forms.FileField(required=False)
    training_step = forms.IntegerField(min_value=0, required=False)


class ApiKeyCreateForm(forms.Form):
    name = forms.CharField(max_length=100)
    scopes = forms.MultipleChoiceField(choices=Scope.choices, widget=forms.CheckboxSelectMultiple)
    expires_at = forms.DateTimeField(
        required=False, widget=forms.DateTimeInput(attrs={"type": "datetime-local"}), help_text="UTC; empty: never."
    )


class AuditFilterForm(forms.Form):
    action = forms.CharField(required=False, max_length=64)
    target = forms.CharField(required=False, max_length=200)
    actor = forms.CharField(required=False, max_length=200)
