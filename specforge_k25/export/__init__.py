"""Serving export of a trained draft."""
