"""`Alias` is serving state: it leaves the adapters app here and is recreated in serving (serving 0003).

Only Django's model state changes in this migration; the table and its rows stay where they are
until serving 0003 takes the model over and renames the table.
"""

from django.db import migrations


class Migration(migrations.Migration):
    dependencies = [
        ("adapters", "0003_control_work"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[migrations.DeleteModel(name="Alias")],
            database_operations=[],
        ),
    ]
