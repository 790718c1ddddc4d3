"""The live run's catalog: tenants of Zipf sizes with thousands of live aliases, made in bulk in the database.

A handful of revisions go through the real pipeline (upload, validation, export by the control worker,
approval): their exports are real files vLLM loads. Every live alias then gets an adapter and an approved
revision of its own, written with bulk inserts (as benchmarks/catalog does), whose export is one of those few:
the node agent fetches by `export_uri` and checks the SHA-256 its policy record lists, and vLLM loads the copy under
the revision's own opaque LoRA name, so each revision is a distinct adapter to every tier while the store holds
a few files. The aliases are `production`, live (revision = desired revision) and not reserved: served on demand.
"""

from __future__ import annotations

from dataclasses import dataclass

from benchmarks.long_tail.trace import zipf_sizes

TENANT_ZIPF_S = 1.05  # the biggest of 100 tenants gets about 2,000 of 10,000 aliases: enough for the scan
# Revision fields the bulk rows take from their template (the rest are the row's own or defaults).
_OWN = {"id", "adapter", "number", "parent", "created_by", "created_by_key", "duplicate_of"}


@dataclass
class Alias:
    tenant: int  # index into LiveCatalog.tenants
    adapter: str  # the model name a client sends (its production alias)
    revision_id: int


@dataclass
class LiveCatalog:
    tenant_ids: list[int]
    tokens: list[str]  # an inference key per tenant
    aliases: list[Alias]
    export_bytes: int  # bytes of one export (the node's disk tier is sized in them)


def build(stack, *, tenants: int, aliases: int, exports: int, say) -> LiveCatalog:
    from adapters.models import Adapter, AdapterRevision
    from benchmarks.stack import bench_tenant
    from serving.models import Alias as AliasRow
    from tenants.models import Tenant

    made = [bench_tenant(f"lt{i:03d}") for i in range(tenants)]
    tenant_ids = [t.id for t, _ in made]
    Tenant.objects.filter(id__in=tenant_ids).update(max_live_aliases=aliases, max_adapters=aliases + exports)
    say(f"{tenants} tenants; exporting {exports} real adapters through the worker")
    templates = [stack.approved_revision(made[0][0], f"template-{k}", seed=1000 + k)[1] for k in range(exports)]
    copied = [f.attname for f in AdapterRevision._meta.concrete_fields if f.name not in _OWN and not f.primary_key]
    sizes = zipf_sizes(aliases, tenants, TENANT_ZIPF_S).tolist()
    rows = [
        Adapter(tenant_id=tenant_ids[t], name=f"a{j:04d}", base_model=stack.base, revision_counter=1)
        for t, size in enumerate(sizes)
        for j in range(size)
    ]
    Adapter.objects.bulk_create(rows, batch_size=2000)
    revisions = []
    for i, adapter in enumerate(rows):
        template = templates[i % exports]
        revision = AdapterRevision(adapter_id=adapter.id, number=1)
        for name in copied:
            setattr(revision, name, getattr(template, name))
        revisions.append(revision)
    AdapterRevision.objects.bulk_create(revisions, batch_size=2000)
    AliasRow.objects.bulk_create(
        [
            AliasRow(adapter_id=r.adapter_id, name=AliasRow.PRODUCTION, revision_id=r.id, desired_revision_id=r.id)
            for r in revisions
        ],
        batch_size=2000,
    )
    index = {tid: t for t, tid in enumerate(tenant_ids)}
    live = [
        Alias(tenant=index[a.tenant_id], adapter=a.name, revision_id=r.id) for a, r in zip(rows, revisions, strict=True)
    ]
    say(f"{len(live)} live aliases over {tenants} tenants (largest {sizes[0]}, smallest {sizes[-1]})")
    return LiveCatalog(
        tenant_ids=tenant_ids,
        tokens=[token for _, token in made],
        aliases=live,
        export_bytes=max(t.export_bytes or t.size_bytes for t in templates),
    )
