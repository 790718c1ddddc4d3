"""Django's debug pages (DEBUG=1, as `make run` sets it) for platform staff only.

With DEBUG on, Django answers an unmatched URL with a page listing every URL pattern of the site, and an
exception in a view with its traceback and local variables. Those are for the people who run the platform,
not for whoever reaches the port: everyone else gets the answers a production server gives (`handler404`,
`handler500`: the plain JSON errors of mint_site/errors.py).

Django offers no hook between an exception and its debug page, so this middleware catches what it can on
both sides: a view's exception in `process_exception` (before Django renders the page), and the 404 of a URL
that matched no route (raised while resolving, before any view middleware) by its response, which carries
no `resolver_match`. Without DEBUG it does nothing.
"""

from __future__ import annotations

import logging

from asgiref.sync import iscoroutinefunction, markcoroutinefunction
from django.conf import settings
from django.core.exceptions import PermissionDenied
from django.http import Http404, HttpRequest, HttpResponse

from mint_site.errors import json_404, json_500

log = logging.getLogger("django.request")


def _unmatched(request: HttpRequest, response: HttpResponse) -> bool:
    """A 404 for a URL that matched no route: under DEBUG, Django's page of the site's URL patterns."""
    return response.status_code == 404 and getattr(request, "resolver_match", None) is None


class StaffOnlyDebugPagesMiddleware:
    """Under DEBUG, the debug 404 and 500 pages only for signed-in staff; plain errors for everyone else.

    Sits after AuthenticationMiddleware (it reads the user) and answers in place of Django's debug pages.
    """

    sync_capable = True
    async_capable = True

    def __init__(self, get_response) -> None:
        self.get_response = get_response
        if iscoroutinefunction(get_response):
            markcoroutinefunction(self)

    def __call__(self, request: HttpRequest):
        if iscoroutinefunction(self):
            return self.__acall__(request)
        response = self.get_response(request)
        if settings.DEBUG and _unmatched(request, response) and not request.user.is_staff:
            return json_404(request)
        return response

    async def __acall__(self, request: HttpRequest):
        response = await self.get_response(request)
        if settings.DEBUG and _unmatched(request, response) and not (await request.auser()).is_staff:
            return json_404(request)
        return response

    def process_exception(self, request: HttpRequest, exception: Exception) -> HttpResponse | None:
        """A view's exception under DEBUG, for someone not staff: the plain answer instead of the debug page.

        Django runs this on a thread in async mode, so the user may be read here. PermissionDenied is left to
        Django (its 403 handler shows no debug page).
        """
        if not settings.DEBUG or isinstance(exception, PermissionDenied) or request.user.is_staff:
            return None
        if isinstance(exception, Http404):
            return json_404(request, exception)
        log.error("Internal Server Error: %s", request.path, exc_info=exception)
        return json_500(request)
