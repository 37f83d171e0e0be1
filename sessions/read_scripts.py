"""The reading Lua scripts of the session store (registered by `sessions.scripts.Scripts`,
after its prelude): each reads one consistent snapshot in one round trip, checks the tenant
first, and returns the images its items point at (`sessions.image_store`) beside them, so an
item comes back with its image parts as they were sent. A key a script follows (the last
response, a chain's links, an image) is named from the tag of the keys it is given: same slot.
"""

# KEYS conv, order, items, images (unused); ARGV tenant, after id ('' none), limit, desc ('1'/'0')
# -> {has_more, {item JSON...}, {sha256, image bytes, ...}}
LIST_ITEMS = """
if not owned(KEYS[1], ARGV[1]) then return fail('NOTFOUND', 'conversation') end
local limit, desc = tonumber(ARGV[3]), ARGV[4] == '1'
local ids
if ARGV[2] == '' then
  ids = redis.call(desc and 'ZREVRANGE' or 'ZRANGE', KEYS[2], 0, limit)
else
  local pos = redis.call('ZSCORE', KEYS[2], ARGV[2])
  if not pos then return fail('NOTFOUND', 'item ' .. ARGV[2]) end
  if desc then ids = redis.call('ZREVRANGEBYSCORE', KEYS[2], '(' .. pos, '-inf', 'LIMIT', 0, limit + 1)
  else ids = redis.call('ZRANGEBYSCORE', KEYS[2], '(' .. pos, '+inf', 'LIMIT', 0, limit + 1) end
end
local more = 0
if #ids > limit then more = 1; ids[#ids] = nil end
local bodies = mget(KEYS[3], ids)
return {more, bodies, images_of(imgbase(KEYS[1]), bodies)}
"""

# KEYS conv, order, items, images (unused); ARGV tenant, key prefix P (the last response shares the slot)
# -> {created_at, metadata, version, last_response, prompt_ids, output_ids, {item JSON...},
#     {sha256, image bytes, ...}}
LOAD_CONVERSATION = """
local h = redis.call('HMGET', KEYS[1], 'tenant', 'created_at', 'metadata', 'version', 'last_response')
if h[1] ~= ARGV[1] then return fail('NOTFOUND', 'conversation') end
local tokens = {false, false}
if h[5] and h[5] ~= '' then tokens = redis.call('HMGET', rkey(ARGV[2], h[5]), 'prompt_ids', 'output_ids') end
local bodies = mget(KEYS[3], redis.call('ZRANGE', KEYS[2], 0, -1))
return {h[2], h[3], h[4], h[5], tokens[1], tokens[2], bodies, images_of(imgbase(KEYS[1]), bodies)}
"""

# KEYS resp, resp items; ARGV tenant -> {{item JSON...} in input order, {sha256, image bytes, ...}}
RESPONSE_ITEMS = """
local h = redis.call('HMGET', KEYS[1], 'tenant', 'input_ids')
if h[1] ~= ARGV[1] then return fail('NOTFOUND', 'response') end
local bodies = mget(KEYS[2], cjson.decode(h[2] or '[]'))
return {bodies, images_of(imgbase(KEYS[1]), bodies)}
"""

# KEYS conv, items; ARGV tenant, item id -> {item JSON, {sha256, image bytes, ...}}
GET_ITEM = """
if not owned(KEYS[1], ARGV[1]) then return fail('NOTFOUND', 'conversation') end
local body = redis.call('HGET', KEYS[2], ARGV[2])
if not body then return fail('NOTFOUND', 'item ' .. ARGV[2]) end
return {body, images_of(imgbase(KEYS[1]), {body})}
"""

# KEYS the newest response's key (every link shares its slot: `sessions.ids`)
# ARGV key prefix P, tenant, newest response id, max depth
# -> {prompt_ids, output_ids (of the newest),
#     {response JSON, {input item JSON...}, {sha256, image bytes, ...}} newest first}
LOAD_CHAIN = """
local prefix, tenant, id = ARGV[1], ARGV[2], ARGV[3]
local tokens = redis.call('HMGET', rkey(prefix, id), 'prompt_ids', 'output_ids')
local out = {tokens[1], tokens[2]}
for _ = 1, tonumber(ARGV[4]) do
  local h = redis.call('HMGET', rkey(prefix, id), 'tenant', 'response', 'input_ids', 'prev')
  if h[1] ~= tenant then return fail('NOTFOUND', 'response ' .. id) end
  local bodies = mget(rkey(prefix, id) .. ':items', cjson.decode(h[3] or '[]'))
  out[#out + 1] = {h[2], bodies, images_of(imgbase(rkey(prefix, id)), bodies)}
  if not h[4] or h[4] == '' then return out end
  id = h[4]
end
return fail('CHAIN', ARGV[4])
"""
