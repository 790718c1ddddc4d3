"""Django for dev tooling's command lines, which run outside manage.py."""

from __future__ import annotations

import os


def setup_django() -> None:
    """Configure Django from mint_site.settings (or DJANGO_SETTINGS_MODULE) and load the apps, unless done already."""
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "mint_site.settings")
    import django
    from django.apps import apps

    if not apps.ready:
        django.setup()
