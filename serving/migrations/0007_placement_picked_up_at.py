from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("serving", "0006_prewarm_turn"),
    ]

    operations = [
        migrations.AddField(
            model_name="placement",
            name="picked_up_at",
            field=models.DateTimeField(blank=True, null=True),
        ),
    ]
