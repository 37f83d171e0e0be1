"""HTTP API and the `longctx` command line."""
