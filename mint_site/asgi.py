"""ASGI entry point: the gateway for `/v1/`, Django for the rest of HTTP (behind body limits), Channels for WebSockets.

Served by uvicorn (as devtools.launcher.web_argv starts it); any ASGI server that speaks WebSockets works.
"""

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "mint_site.settings")
django_asgi_app = get_asgi_application()

from channels.auth import AuthMiddlewareStack  # noqa: E402  (needs Django set up first)
from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402

from adapters import upload_gate, uploads  # noqa: E402
from frontend.routing import websocket_urlpatterns  # noqa: E402
from mint_site.limits import BodyLimit  # noqa: E402
from mint_site.ws_origin import SameOriginValidator  # noqa: E402
from serving.gateway.asgi import with_gateway  # noqa: E402
from tenants import header_auth  # noqa: E402

application = with_gateway(
    ProtocolTypeRouter(
        {
            # Bodies are checked against the route's and the caller's limits before Django reads them.
            "http": BodyLimit(
                django_asgi_app,
                upload_routes=upload_gate.UPLOAD_ROUTES,
                upload_gate=upload_gate.allowance,
                caller_gate=header_auth.known_caller,  # any other large body: its caller is known before it is read
                route_limits=[uploads.PART_ROUTE_LIMIT],  # a resumable upload's parts: up to MINT_UPLOAD_PART_BYTES
            ),
            # Only the site's own origin (scheme, host and port) or CSRF_TRUSTED_ORIGINS may open a socket.
            "websocket": SameOriginValidator(AuthMiddlewareStack(URLRouter(websocket_urlpatterns))),
        }
    )
)
