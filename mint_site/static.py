"""Static files through WhiteNoise without making every request synchronous.

WhiteNoise's middleware is synchronous only; one sync middleware in the chain makes Django
run every view, the async gateway included, through a thread and a fresh event loop (and
with it a fresh upstream connection per request). This wrapper hands only static paths to
WhiteNoise and keeps every other request on the event loop.
"""

from __future__ import annotations

from asgiref.sync import iscoroutinefunction, markcoroutinefunction, sync_to_async
from django.conf import settings
from whitenoise.middleware import WhiteNoiseMiddleware


class StaticFilesMiddleware:
    sync_capable = True
    async_capable = True

    def __init__(self, get_response):
        self.get_response = get_response
        self.is_async = iscoroutinefunction(get_response)
        if self.is_async:
            markcoroutinefunction(self)
        self.whitenoise = WhiteNoiseMiddleware(self._not_static)
        self.prefix = settings.STATIC_URL if settings.STATIC_URL.startswith("/") else f"/{settings.STATIC_URL}"

    @staticmethod
    def _not_static(request):
        return None

    def __call__(self, request):
        if self.is_async:
            return self._acall(request)
        if request.path_info.startswith(self.prefix):
            response = self.whitenoise(request)
            if response is not None:
                return response
        return self.get_response(request)

    async def _acall(self, request):
        if request.path_info.startswith(self.prefix):
            response = await sync_to_async(self.whitenoise, thread_sensitive=False)(request)
            if response is not None:
                return response
        return await self.get_response(request)
