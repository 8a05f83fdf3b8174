"""Draft service: proposes token blocks from the small model."""
