"""longctx engine: model loading, paged KV cache, attention backends and serving loop."""
