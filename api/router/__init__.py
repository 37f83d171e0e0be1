"""`longctx route`: a cache-aware front for N `longctx serve` replicas on one state Redis.

- `affinity`: the key a request's KV cache follows (its conversation, its `previous_response_id`
  chain, its `prompt_cache_key`), scoped per tenant by a hash of `Authorization`;
- `replicas`: the replicas, their health (from `/ready`) and load (requests in flight here);
- `proxy`: the ASGI app that picks a replica, passes the request and the response through
  (streams unbuffered), retries a 429 once elsewhere and learns where each key went;
- `keys`: with `--api-keys-file`, the replicas' key check, done here first;
- `ws_relay`: the Responses WebSocket mode, relayed to one replica per connection;
- `metrics`: the router's own `/metrics`.
"""
