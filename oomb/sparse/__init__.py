"""Page-selection policies for page-level top-k sparse attention."""

from oomb.sparse.selection import PageSelection, select_pages, store_key_summary

__all__ = ["PageSelection", "select_pages", "store_key_summary"]
