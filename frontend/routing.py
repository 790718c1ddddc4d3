"""WebSocket routes, mounted by mint_site.asgi behind origin and session checks."""

websocket_urlpatterns: list = []
