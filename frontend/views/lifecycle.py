"""The dashboard's side of an adapter's whole life beyond approval and activation: create an adapter, edit its
description and tags, set its retention, deactivate an alias, archive, restore and keep revisions, download a
revision's files, compare two revisions, try one in the playground, and delete the adapter.

Each write calls the same service as the REST API with the person as the actor, and is checked here against the
capability the API asks (`page(post=…)`); its result or refusal is shown next to the control used (`act`).
Destructive ones (deactivate, archive, delete) come from a confirmation on the page, whatever sent them.
"""

from __future__ import annotations

from django import forms
from django.contrib import messages
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseRedirect
from django.shortcuts import redirect, render
from django.urls import reverse
from django.views.decorators.http import require_GET, require_POST

from adapters import downloads
from adapters import services as adapter_services
from adapters.serializers import ADAPTER_NAME, ALIAS_NAME
from frontend.selectors import detail, lifecycle
from frontend.views.base import (
    act,
    adapter_or_404,
    adapter_url,
    anchor_tag,
    check_tenant_field,
    check_write_rate,
    cleaned,
    found,
    page,
    revision_or_404,
    revision_url,
    safe_next,
)
from mint_site.errors import MintError
from serving import services as serving_services
from serving.models import Alias
from serving.services import playground
from tenants.access import Capability


class AdapterCreateForm(forms.Form):
    name = forms.RegexField(
        ADAPTER_NAME,
        label="Name",
        max_length=64,
        error_messages={
            "invalid": "Use 1-64 lowercase letters, digits, '.', '_' or '-', starting with one of the first two."
        },
    )
    base_model = forms.CharField(label="Base model", max_length=200)
    description = forms.CharField(label="Description", required=False, max_length=2000)


class AdapterEditForm(forms.Form):
    description = forms.CharField(label="Description", required=False, max_length=2000)
    tags = forms.CharField(label="Tags", required=False, max_length=600, help_text="Comma-separated.")

    def clean_tags(self) -> list[str]:
        return [t.strip() for t in self.cleaned_data["tags"].split(",") if t.strip()]


class RetentionForm(forms.Form):
    keep_last = forms.IntegerField(label="Keep the newest", min_value=1, required=False)
    grace_days = forms.IntegerField(label="Grace (days)", min_value=0, required=False)


class AliasForm(forms.Form):
    alias = forms.RegexField(ALIAS_NAME, label="Alias", required=False)


class ArchiveForm(forms.Form):
    keep_source = forms.BooleanField(label="Keep its source", required=False)


class PlaygroundForm(forms.Form):
    prompt = forms.CharField(label="Prompt", max_length=playground.PLAYGROUND_MAX_PROMPT, strip=False)
    max_tokens = forms.IntegerField(
        label="Max tokens", min_value=1, max_value=playground.PLAYGROUND_MAX_TOKENS, required=False
    )


# ---------------------------------------------------------------- adapters


@require_POST
@page(post=Capability.REGISTER)
def adapter_create(request: HttpRequest) -> HttpResponse:
    """Create an adapter from the overview; its page opens on success, the overview shows why not otherwise."""
    overview = reverse("frontend:overview")
    try:
        check_tenant_field(request)
        check_write_rate(request)
        data = cleaned(AdapterCreateForm(request.POST))
        base = lifecycle.base_models().filter(name=data["base_model"]).first()
        if base is None:
            raise MintError(f"Base model: no base model named {data['base_model']!r}.", code="unknown_base_model")
        adapter = adapter_services.adapter_create(
            tenant=request.viewer.tenant,
            name=data["name"],
            base_model=base,
            description=data["description"],
            by=request.viewer.access.actor,
        )
    except MintError as exc:
        messages.error(request, exc.message, extra_tags=anchor_tag("create"))
        return redirect(f"{overview}#result-create")
    messages.success(
        request,
        f"Adapter {adapter.name} created on {base.name}. Register its first revision below.",
        extra_tags=anchor_tag("register"),
    )
    return redirect(f"{adapter_url(adapter)}#register")


@require_POST
@page(post=Capability.REGISTER)
def adapter_edit(request: HttpRequest, name: str) -> HttpResponse:
    adapter = adapter_or_404(request, name)

    def run() -> str:
        data = cleaned(AdapterEditForm(request.POST))
        adapter_services.adapter_update(
            adapter=adapter, by=request.viewer.access.actor, description=data["description"], tags=data["tags"]
        )
        return "Description and tags saved."

    return act(request, adapter_url(adapter), run, anchor="settings")


@require_POST
@page(post=Capability.DECIDE)
def adapter_retention(request: HttpRequest, name: str) -> HttpResponse:
    adapter = adapter_or_404(request, name)

    def run() -> str:
        data = cleaned(RetentionForm(request.POST))
        adapter = adapter_services.adapter_set_retention(
            adapter=adapter_or_404(request, name),
            keep_last=data["keep_last"],
            grace_days=data["grace_days"],
            by=request.viewer.access.actor,
        )
        preview = lifecycle.retention_of(adapter)
        policy = preview["policy"]
        if not policy["keep_last"]:
            return "Retention saved: none in force (the plan keeps every revision)."
        count = len(preview["would_archive"])
        return (
            f"Retention saved: keeps the newest {policy['keep_last']}, the named (within {policy['grace_days']} days), "
            f"the kept and the pending; {count} revision{'s' if count != 1 else ''} will be archived by its next run."
        )

    return act(request, adapter_url(adapter), run, anchor="retention")


@require_POST
@page(post=Capability.DECIDE)
def adapter_delete(request: HttpRequest, name: str) -> HttpResponse:
    """Delete the adapter (the confirmation asks for its name typed again); the overview opens on success."""
    adapter = adapter_or_404(request, name)
    if request.POST.get("confirm_name", "").strip() != adapter.name:
        messages.error(
            request, f"Type the adapter's name, {adapter.name}, to delete it.", extra_tags=anchor_tag("delete")
        )
        return redirect(f"{adapter_url(adapter)}#result-delete")
    try:
        check_tenant_field(request)
        check_write_rate(request)
        deleted = serving_services.adapter_delete(adapter=adapter, by=request.viewer.access.actor)
    except MintError as exc:
        messages.error(request, exc.message, extra_tags=anchor_tag("delete"))
        return redirect(f"{adapter_url(adapter)}#result-delete")
    archived = len(deleted.archived)
    with_it = f"{archived} revision{'s' if archived != 1 else ''} archived with it"
    if not archived:
        with_it = "its revisions were archived"
    messages.success(
        request,
        f"Adapter {deleted.adapter} deleted; {with_it}. Its name is not given to a new adapter.",
        extra_tags=anchor_tag("create"),
    )
    return redirect(f"{reverse('frontend:overview')}#result-create")


@require_POST
@page(post=Capability.DECIDE)
def alias_deactivate(request: HttpRequest, name: str) -> HttpResponse:
    adapter = adapter_or_404(request, name)
    form = AliasForm(request.POST)
    alias = (form.cleaned_data.get("alias") if form.is_valid() else "") or Alias.PRODUCTION

    def run() -> str:
        cleaned(form)
        named = serving_services.alias_deactivate(adapter=adapter, alias_name=alias, by=request.viewer.access.actor)
        model = adapter.name if alias == Alias.PRODUCTION else f"{adapter.name}:{alias}"
        released = f" {', '.join(named)} leave the nodes unless another alias names them." if named else ""
        return f"{alias} deactivated: requests for {model} now answer 404 model_not_found.{released}"

    return act(request, safe_next(request, adapter_url(adapter)), run, anchor="aliases")


# ---------------------------------------------------------------- revisions


@require_POST
@page(post=Capability.DECIDE)
def revision_archive(request: HttpRequest, name: str, number: int) -> HttpResponse:
    adapter = adapter_or_404(request, name)
    revision = revision_or_404(adapter, number)

    def run() -> str:
        keep_source = cleaned(ArchiveForm(request.POST))["keep_source"]
        serving_services.revision_archive(revision=revision, by=request.viewer.access.actor, keep_source=keep_source)
        kept = "its source is kept, so it can be restored" if keep_source else "its files are removed"
        return f"r{number} archived: {kept}; its record, audit trail and usage stay."

    return act(request, revision_url(adapter, number), run, anchor=f"r{number}")


@require_POST
@page(post=Capability.DECIDE)
def revision_restore(request: HttpRequest, name: str, number: int) -> HttpResponse:
    adapter = adapter_or_404(request, name)
    revision = revision_or_404(adapter, number)

    def run() -> str:
        restored = adapter_services.revision_restore(revision=revision, by=request.viewer.access.actor)
        return f"r{number} restored ({restored.state}); its export is being written again from its source."

    return act(request, revision_url(adapter, number), run, anchor=f"r{number}")


@require_POST
@page(post=Capability.REGISTER)
def revision_keep(request: HttpRequest, name: str, number: int) -> HttpResponse:
    adapter = adapter_or_404(request, name)
    revision = revision_or_404(adapter, number)
    keep = request.POST.get("keep") == "on"

    def run() -> str:
        adapter_services.revision_set_keep(revision=revision, keep=keep, by=request.viewer.access.actor)
        return f"r{number} is marked keep: retention never archives it." if keep else f"r{number} is no longer kept."

    return act(request, revision_url(adapter, number), run, anchor=f"r{number}")


@require_GET
@page()
def revision_download(request: HttpRequest, name: str, number: int, filename: str) -> HttpResponse:
    """A fresh expiring link to one exported file (signed, or the store's presigned URL), followed at once."""
    revision = revision_or_404(adapter_or_404(request, name), number)
    try:
        links = downloads.download_links(revision=revision, request=request)
    except MintError as exc:
        raise Http404(exc.message) from None
    link = found(next((x for x in links if x.name == filename), None), "No such file.")
    return HttpResponseRedirect(link.url)


@require_POST
@page(post=Capability.INFERENCE)
def revision_playground(request: HttpRequest, name: str, number: int) -> HttpResponse:
    """Send a prompt to this revision; the completion is the result shown in the playground."""
    adapter = adapter_or_404(request, name)
    revision = revision_or_404(adapter, number)

    def run() -> str:
        data = cleaned(PlaygroundForm(request.POST))
        answer = playground.playground_complete(
            revision=revision, prompt=data["prompt"], max_tokens=data["max_tokens"] or 64
        )
        return (
            f"r{number} answered ({answer.prompt_tokens} prompt + {answer.completion_tokens} completion tokens, "
            f"{answer.ms:.0f} ms, metered as your inference): {answer.text}"
        )

    return act(request, f"{revision_url(adapter, number)}#playground", run, anchor="playground")


@require_GET
@page()
def adapter_diff(request: HttpRequest, name: str) -> HttpResponse:
    """Two revisions side by side (`?a=3&b=5`): config, each module's shapes and norms, evaluation scores."""
    adapter = adapter_or_404(request, name)
    pair = []
    for side in ("a", "b"):
        raw = (request.GET.get(side) or "").strip().removeprefix("r")
        revision = detail.revision_get(adapter=adapter, number=int(raw)) if raw.isdigit() else None
        if revision is None:
            raise Http404(f"Choose two revisions of {adapter.name} to compare.")
        pair.append(revision)
    context = {
        "adapter": adapter,
        "a": pair[0],
        "b": pair[1],
        "diff": lifecycle.diff_of(*pair),
        "numbers": lifecycle.revision_numbers(adapter),
    }
    return render(request, "frontend/diff.html", context)
