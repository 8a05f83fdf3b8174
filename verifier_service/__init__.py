"""Verifier service: the target model over a paged KV cache."""
