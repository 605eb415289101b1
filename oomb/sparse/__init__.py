"""Page-selection policies for page-level top-k sparse attention."""

from oomb.sparse.selection import DEFAULT_SCORE, SCORES, PageSelection, select_pages, store_key_summary

__all__ = ["DEFAULT_SCORE", "SCORES", "PageSelection", "select_pages", "store_key_summary"]
