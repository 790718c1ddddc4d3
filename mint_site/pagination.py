"""Cursor pagination: stable under inserts and cheap at any depth of a large catalog."""

from django.core.exceptions import ValidationError
from rest_framework.exceptions import NotFound
from rest_framework.pagination import CursorPagination

from mint_site.errors import MintError


class InvalidCursor(MintError):
    """A `cursor` that no page of this list gave out (edited, truncated, or from another list's ordering): a 400, not
    DRF's 404, which would read as "the list is gone"."""

    code = "invalid_cursor"

    def __init__(self) -> None:
        super().__init__("cursor: not one this list gave out; follow the `next` and `previous` links as they are.")


class CursorPage(CursorPagination):
    page_size = 50
    page_size_query_param = "limit"
    max_page_size = 200
    ordering = "-id"

    def decode_cursor(self, request):
        try:
            return super().decode_cursor(request)
        except NotFound as exc:
            raise InvalidCursor() from exc

    def paginate_queryset(self, queryset, request, view=None):
        # The cursor's position goes into a filter on the ordering's field: one of the wrong type (`p=abc` for an
        # id) would fail there, as a 500.
        cursor = self.decode_cursor(request)
        if cursor is not None and cursor.position is not None:
            field = queryset.model._meta.get_field(self.get_ordering(request, queryset, view)[0].lstrip("-"))
            try:
                field.to_python(cursor.position)
            except ValidationError as exc:
                raise InvalidCursor() from exc
        return super().paginate_queryset(queryset, request, view)
