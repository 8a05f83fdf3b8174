"""Serving engine: KV block management, scheduling and model runners."""
