"""`Cache-Control: no-store` on every dashboard response.

A dashboard page shows state that changes under it (a revision's state, an alias's target, a key's
revocation). A page kept by the browser, and shown again by Back or Forward, would show a state
that is over, with buttons for it. `no-store` keeps every dashboard page out of the HTTP cache and
the back/forward cache, so going back re-reads the page from the server. Static files and the API
are left alone.
"""

from __future__ import annotations

from asgiref.sync import iscoroutinefunction, markcoroutinefunction
from django.http import HttpRequest, HttpResponse

FRONTEND_NAMESPACE = "frontend"


def _mark(request: HttpRequest, response: HttpResponse) -> HttpResponse:
    match = getattr(request, "resolver_match", None)
    if match is not None and FRONTEND_NAMESPACE in match.namespaces:
        response["Cache-Control"] = "no-store"
    return response


class NoStoreMiddleware:
    """Sets `Cache-Control: no-store` on the responses of the dashboard's views (namespace `frontend`)."""

    sync_capable = True
    async_capable = True

    def __init__(self, get_response) -> None:
        self.get_response = get_response
        if iscoroutinefunction(get_response):
            markcoroutinefunction(self)

    def __call__(self, request: HttpRequest):
        if iscoroutinefunction(self):
            return self.__acall__(request)
        return _mark(request, self.get_response(request))

    async def __acall__(self, request: HttpRequest) -> HttpResponse:
        return _mark(request, await self.get_response(request))
