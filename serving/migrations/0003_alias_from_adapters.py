"""`Alias` joins serving, rows and all: the model state is recreated over the existing table
`adapters_alias` (adapters 0004 dropped it from the adapters app's state only), then the table
is renamed to `serving_alias`. No row is copied, so none can be lost.
"""

import django.db.models.deletion
import django.utils.timezone
from django.db import migrations, models


def alias_fields():
    revision = "adapters.adapterrevision"
    return [
        ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name="ID")),
        ("name", models.CharField(max_length=32)),
        ("rollback_pending", models.BooleanField(default=False, help_text="The desired revision is a rollback.")),
        ("updated_by", models.CharField(blank=True, max_length=200)),
        ("updated_at", models.DateTimeField(default=django.utils.timezone.now)),
        (
            "adapter",
            models.ForeignKey(
                on_delete=django.db.models.deletion.CASCADE, related_name="aliases", to="adapters.adapter"
            ),
        ),
        (
            "desired_revision",
            models.ForeignKey(
                blank=True,
                null=True,
                on_delete=django.db.models.deletion.PROTECT,
                related_name="desired_aliases",
                to=revision,
            ),
        ),
        (
            "previous_revision",
            models.ForeignKey(
                blank=True,
                help_text="What the alias pointed at before its last flip: the default rollback target.",
                null=True,
                on_delete=django.db.models.deletion.PROTECT,
                related_name="+",
                to=revision,
            ),
        ),
        (
            "revision",
            models.ForeignKey(
                blank=True,
                null=True,
                on_delete=django.db.models.deletion.PROTECT,
                related_name="live_aliases",
                to=revision,
            ),
        ),
    ]


class Migration(migrations.Migration):
    dependencies = [
        ("adapters", "0004_alias_moves_to_serving"),
        ("serving", "0002_nodes_placements"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.CreateModel(
                    name="Alias",
                    fields=alias_fields(),
                    options={"verbose_name_plural": "aliases", "db_table": "adapters_alias"},
                ),
                migrations.AddConstraint(
                    model_name="alias",
                    constraint=models.UniqueConstraint(fields=("adapter", "name"), name="alias_adapter_name_unique"),
                ),
            ],
            database_operations=[],
        ),
        migrations.AlterModelTable(name="alias", table=None),
    ]
