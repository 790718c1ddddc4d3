"""Run the test OpenID Connect provider: `python -m tests.oidc_provider.serve <port> <spec.json>`.

The spec names its people (`users`: username, password, email) and its client applications (`clients`: name,
client_id, client_secret, redirect_uri); they are created in a fresh database, then the provider serves on
127.0.0.1:<port> until it is killed.
"""

import json
import os
import sys

import django


def main() -> None:
    port, spec_path = int(sys.argv[1]), sys.argv[2]
    os.environ["DJANGO_SETTINGS_MODULE"] = "tests.oidc_provider.settings"
    django.setup()
    from django.contrib.auth import get_user_model
    from django.core.management import call_command
    from django.core.servers.basehttp import run
    from django.core.wsgi import get_wsgi_application
    from oauth2_provider.models import Application

    call_command("migrate", verbosity=0, interactive=False)
    with open(spec_path) as spec_file:
        spec = json.load(spec_file)
    for person in spec["users"]:
        get_user_model().objects.create_user(person["username"], person["email"], person["password"])
    for client in spec["clients"]:
        Application.objects.create(
            name=client["name"],
            client_id=client["client_id"],
            client_secret=client["client_secret"],
            client_type=Application.CLIENT_CONFIDENTIAL,
            authorization_grant_type=Application.GRANT_AUTHORIZATION_CODE,
            redirect_uris=client["redirect_uri"],
            algorithm=Application.RS256_ALGORITHM,
            skip_authorization=True,
        )
    run("127.0.0.1", port, get_wsgi_application(), threading=True)


if __name__ == "__main__":
    main()
