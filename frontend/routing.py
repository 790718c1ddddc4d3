"""WebSocket routes, mounted by mint_site.asgi behind origin and session checks."""

from django.urls import path

from frontend.consumers import LiveEventsConsumer

websocket_urlpatterns: list = [
    path("ws/live/", LiveEventsConsumer.as_asgi()),
]
