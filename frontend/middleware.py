"""`Cache-Control: no-store` on every dashboard response.

A dashboard page shows state that changes under it (a revision's state, an alias's target, a key's
revocation). A page kept by the browser, and shown again by Back or Forward, would show a state
that is over, with buttons for it. `no-store` keeps every dashboard page out of the HTTP cache and
the back/forward cache, so going back re-reads the page from the server. Static files and the API
are left alone.
"""

from __future__ import annotations

from asgiref.sync import iscoroutinefunction
from django.http import HttpRequest, HttpResponse
from django.utils.decorators import sync_and_async_middleware

FRONTEND_NAMESPACE = "frontend"


def _mark(request: HttpRequest, response: HttpResponse) -> HttpResponse:
    match = getattr(request, "resolver_match", None)
    if match is not None and FRONTEND_NAMESPACE in match.namespaces:
        response["Cache-Control"] = "no-store"
    return response


@sync_and_async_middleware
def NoStoreMiddleware(get_response):
    """Sets `Cache-Control: no-store` on the responses of the dashboard's views (namespace `frontend`)."""
    if iscoroutinefunction(get_response):

        async def middleware(request: HttpRequest) -> HttpResponse:
            return _mark(request, await get_response(request))

    else:

        def middleware(request: HttpRequest) -> HttpResponse:
            return _mark(request, get_response(request))

    return middleware
