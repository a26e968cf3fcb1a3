"""Bridges from the stop machinery into each library's own mechanisms."""
