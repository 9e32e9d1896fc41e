"""Integrations with model libraries (each imported only when asked for)."""
