from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("adapters", "0006_adapter_replicas"),
    ]

    operations = [
        migrations.AddField(
            model_name="adapterrevision",
            name="picked_up_at",
            field=models.DateTimeField(blank=True, null=True),
        ),
    ]
