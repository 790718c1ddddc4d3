"""Cursor pagination: stable under inserts and cheap at any depth of a large catalog."""

from rest_framework.pagination import CursorPagination


class CursorPage(CursorPagination):
    page_size = 50
    page_size_query_param = "limit"
    max_page_size = 200
    ordering = "-id"
