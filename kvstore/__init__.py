"""Paged KV memory: page pool, KV tensors and their layout spec (never imports engine)."""
