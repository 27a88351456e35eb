"""Renderers: turn result objects into text and JSON. Compute never prints."""
