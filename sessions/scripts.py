"""The Lua scripts of the session store: one per change of more than one key, plus the reads
that must see one consistent snapshot in one round trip (those in `sessions.read_scripts`). Key
layout: `sessions.store`.

Every writing script checks all it needs (tenant, lease fence, duplicate ids, final status)
before its first write, so a failed check writes nothing; failures are error replies
`LC_<CODE> <detail>` (`sessions.errors.from_script_error`). Each also recognises its own
replay (the same call tried again after its reply was lost) and answers as the first did.
"""

from __future__ import annotations

from redis.asyncio import Redis
from redis.commands.core import AsyncScript

from sessions.image_store import IMAGES_LUA
from sessions.read_scripts import GET_ITEM, LIST_ITEMS, LOAD_CHAIN, LOAD_CONVERSATION, RESPONSE_ITEMS

_PRELUDE = """
local function fail(code, detail) return redis.error_reply('LC_' .. code .. ' ' .. detail) end
local TERMINAL = {completed = true, failed = true, cancelled = true, incomplete = true}
local function touch(ttl, keys) for _, k in ipairs(keys) do redis.call('EXPIRE', k, ttl) end end
-- how many of the n ids at argv[first], argv[first + 2], ... are fields of hash h
local function present(h, argv, first, n)
  local found = 0
  for i = 0, n - 1 do found = found + redis.call('HEXISTS', h, argv[first + 2 * i]) end
  return found
end
"""

_PRELUDE_ITEMS = """
-- append n (id, body) pairs at the conversation's next positions; the version goes up once
local function append(conv, order, items, index, argv, first, n, data)
  local base = imgbase(conv)
  for i = 0, n - 1 do
    local pos = redis.call('HINCRBY', conv, 'next', 1) - 1
    redis.call('ZADD', order, pos, argv[first + 2 * i])
    put_item(items, index, base, argv[first + 2 * i], argv[first + 2 * i + 1], data)
  end
  if n == 0 then return tonumber(redis.call('HGET', conv, 'version')) end
  return redis.call('HINCRBY', conv, 'version', 1)
end
local function hset_pairs(h, argv, first, n)
  for i = 0, n - 1 do redis.call('HSET', h, argv[first + 2 * i], argv[first + 2 * i + 1]) end
end
local function put_items(h, index, argv, first, n, data)
  local base = imgbase(h)
  for i = 0, n - 1 do put_item(h, index, base, argv[first + 2 * i], argv[first + 2 * i + 1], data) end
end
-- HMGET in chunks: unpack() has a stack limit
local function mget(h, ids)
  local out = {}
  for i = 1, #ids, 1000 do
    for _, v in ipairs(redis.call('HMGET', h, unpack(ids, i, math.min(i + 999, #ids)))) do out[#out + 1] = v end
  end
  return out
end
local function owned(conv, tenant) return redis.call('HGET', conv, 'tenant') == tenant end
-- the key of response `id` under prefix p (`sessions.keys.Keys.resp`): same slot tag
local function rkey(p, id) return p .. ':{' .. (string.gsub(string.sub(id, -16), '[{}]', '_')) .. '}:resp:' .. id end
"""

# KEYS conv, order, items, images; ARGV tenant, created_at, metadata, ttl, n, (id, body) * n,
#      then the images section (`sessions.image_store.image_args`)
CREATE_CONVERSATION = """
if redis.call('EXISTS', KEYS[1]) == 1 then
  if owned(KEYS[1], ARGV[1]) then return tonumber(redis.call('HGET', KEYS[1], 'version')) end
  return fail('CONFLICT', 'conversation id in use')
end
redis.call('HSET', KEYS[1], 'tenant', ARGV[1], 'created_at', ARGV[2], 'metadata', ARGV[3],
  'version', 0, 'next', 0, 'last_response', '')
local n, base = tonumber(ARGV[5]), imgbase(KEYS[1])
local v = append(KEYS[1], KEYS[2], KEYS[3], KEYS[4], ARGV, 6, n, image_table(ARGV, 6 + 2 * n))
touch(ARGV[4], KEYS)
touch_images(base, KEYS[4], ARGV[4])
return v
"""

# KEYS conv, order, items, images; ARGV tenant, ttl, n, (id, body) * n, images section.
# All ids present: a replay.
APPEND_ITEMS = """
if not owned(KEYS[1], ARGV[1]) then return fail('NOTFOUND', 'conversation') end
local n, base = tonumber(ARGV[3]), imgbase(KEYS[1])
local found = present(KEYS[3], ARGV, 4, n)
if n > 0 and found == n then return tonumber(redis.call('HGET', KEYS[1], 'version')) end
if found > 0 then return fail('CONFLICT', 'an item id is already in the conversation') end
local v = append(KEYS[1], KEYS[2], KEYS[3], KEYS[4], ARGV, 4, n, image_table(ARGV, 4 + 2 * n))
touch(ARGV[2], KEYS)
touch_images(base, KEYS[4], ARGV[2])
return v
"""

# KEYS conv, order, items, images; ARGV tenant, ttl, item id
DELETE_ITEM = """
if not owned(KEYS[1], ARGV[1]) then return fail('NOTFOUND', 'conversation') end
if redis.call('ZREM', KEYS[2], ARGV[3]) == 0 then return fail('NOTFOUND', 'item ' .. ARGV[3]) end
local base = imgbase(KEYS[1])
local body = redis.call('HGET', KEYS[3], ARGV[3])
redis.call('HDEL', KEYS[3], ARGV[3])
if body then ref(base, KEYS[4], body, -1, {}) end
redis.call('HSET', KEYS[1], 'last_response', '')  -- its stored tokens no longer match the items
local v = redis.call('HINCRBY', KEYS[1], 'version', 1)
touch(ARGV[2], KEYS)
touch_images(base, KEYS[4], ARGV[2])
return v
"""

# KEYS conv, order, items, images; ARGV tenant, ttl, metadata
UPDATE_CONVERSATION = """
if not owned(KEYS[1], ARGV[1]) then return fail('NOTFOUND', 'conversation') end
redis.call('HSET', KEYS[1], 'metadata', ARGV[3])
touch(ARGV[2], KEYS)
touch_images(imgbase(KEYS[1]), KEYS[4], ARGV[2])
return 1
"""

# KEYS conv, order, items, images, lease; ARGV tenant
DELETE_CONVERSATION = """
if not owned(KEYS[1], ARGV[1]) then return fail('NOTFOUND', 'conversation') end
drop_images(imgbase(KEYS[1]), KEYS[4])
redis.call('DEL', unpack(KEYS))
return 1
"""

# KEYS conv, lease; ARGV tenant, response id, ttl ms. Same response: a new fence. The fence
# counter is the conversation hash's field `fence` (one slot; it never goes back while the
# conversation exists, and a deleted conversation's lease is gone with it).
ACQUIRE_LEASE = """
if not owned(KEYS[1], ARGV[1]) then return fail('NOTFOUND', 'conversation') end
local held = redis.call('GET', KEYS[2])
if held then
  local holder = string.match(held, '^(.*):%d+$')
  if holder ~= ARGV[2] then return fail('BUSY', holder) end
end
local fence = redis.call('HINCRBY', KEYS[1], 'fence', 1)
redis.call('SET', KEYS[2], ARGV[2] .. ':' .. fence, 'PX', ARGV[3])
return fence
"""

# KEYS lease; ARGV lease value, ttl ms
RENEW_LEASE = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return fail('LEASELOST', ARGV[1]) end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
"""

# KEYS lease; ARGV lease value
RELEASE_LEASE = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
return redis.call('DEL', KEYS[1])
"""

# KEYS conv, order, items, images, lease, resp, resp items, resp images
# ARGV 1 tenant, 2 ttl, 3 lease value, 4 base version ('' unknown), 5 response id, 6 status,
#      7 response JSON, 8 append ('1'/'0'), 9 n items, 10 n fields, 11 n input items,
#      then (id, body) * n to append, (field, value) * n fields, (id, body) * n input items,
#      then the images section
COMMIT_TURN = """
local conv, order, items, images, lease, resp, resp_items, resp_images = unpack(KEYS)
if redis.call('GET', lease) ~= ARGV[3] then
  if redis.call('HGET', resp, 'committed') == ARGV[3] then
    return tonumber(redis.call('HGET', conv, 'version')) or 0
  end
  return fail('LEASELOST', ARGV[3])
end
if not owned(conv, ARGV[1]) then return fail('NOTFOUND', 'conversation') end
local old = redis.call('HGET', resp, 'status')
if old and TERMINAL[old] then return fail('CONFLICT', 'response is already ' .. old) end
local n, nf, ni = tonumber(ARGV[9]), tonumber(ARGV[10]), tonumber(ARGV[11])
local version = tonumber(redis.call('HGET', conv, 'version'))
if ARGV[8] == '1' and present(items, ARGV, 12, n) > 0 then
  return fail('CONFLICT', 'an item id is already in the conversation')
end
local data = image_table(ARGV, 12 + 2 * (n + nf + ni))
if ARGV[8] == '1' then
  local before = version
  version = append(conv, order, items, images, ARGV, 12, n, data)
  -- this turn's prompt + output tokens describe the items only if nothing changed them meanwhile
  redis.call('HSET', conv, 'last_response', tostring(before) == ARGV[4] and ARGV[5] or '')
end
redis.call('HSET', resp, 'tenant', ARGV[1], 'status', ARGV[6], 'response', ARGV[7], 'committed', ARGV[3])
hset_pairs(resp, ARGV, 12 + 2 * n, nf)
put_items(resp_items, resp_images, ARGV, 12 + 2 * (n + nf), ni, data)
redis.call('DEL', lease)
touch(ARGV[2], {conv, order, items, images, resp, resp_items, resp_images})
touch_images(imgbase(conv), images, ARGV[2])  -- a response from before tags has its own slot
touch_images(imgbase(resp), resp_images, ARGV[2])
return version
"""

# KEYS resp, resp items, resp images; ARGV 1 tenant, 2 ttl, 3 status, 4 response JSON,
#      5 n fields, 6 n items, then (field, value) * n fields, (id, body) * n items, images section
SAVE_RESPONSE = """
local owner = redis.call('HGET', KEYS[1], 'tenant')
if owner and owner ~= ARGV[1] then return fail('NOTFOUND', 'response') end
local old = redis.call('HGET', KEYS[1], 'status')
if old and TERMINAL[old] then
  if redis.call('HGET', KEYS[1], 'response') == ARGV[4] then return 0 end
  return fail('CONFLICT', 'response is already ' .. old)
end
local nf, ni = tonumber(ARGV[5]), tonumber(ARGV[6])
redis.call('HSET', KEYS[1], 'tenant', ARGV[1], 'status', ARGV[3], 'response', ARGV[4])
hset_pairs(KEYS[1], ARGV, 7, nf)
put_items(KEYS[2], KEYS[3], ARGV, 7 + 2 * nf, ni, image_table(ARGV, 7 + 2 * (nf + ni)))
touch(ARGV[2], KEYS)
touch_images(imgbase(KEYS[1]), KEYS[3], ARGV[2])
return 1
"""

# KEYS resp, resp items, events, resp images; ARGV tenant
DELETE_RESPONSE = """
if not owned(KEYS[1], ARGV[1]) then return fail('NOTFOUND', 'response') end
drop_images(imgbase(KEYS[1]), KEYS[4])
redis.call('DEL', unpack(KEYS))
return 1
"""

# KEYS events; ARGV stream id ('0-<seq + 1>'), event JSON, ttl
APPEND_EVENT = """
local last = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)
if last[1] and last[1][1] == ARGV[1] then return 0 end
local r = redis.pcall('XADD', KEYS[1], ARGV[1], 'e', ARGV[2])
if type(r) == 'table' and r.err then return fail('CONFLICT', 'event ' .. ARGV[1] .. ' is not after the last one') end
redis.call('EXPIRE', KEYS[1], ARGV[3])
return 1
"""

# KEYS jobs; ARGV group, consumer, job id -> 1 if still ours (idle time reset), else 0
HEARTBEAT_JOB = """
local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[3], ARGV[3], 1)
if #p == 0 or p[1][2] ~= ARGV[2] then return 0 end
redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[3], 'JUSTID')
return 1
"""

# KEYS idem; ARGV response id
FORGET_IDEMPOTENCY = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
return redis.call('DEL', KEYS[1])
"""


class Scripts:
    """The scripts above registered on one client (run by EVALSHA, loaded again on NOSCRIPT)."""

    def __init__(self, client: Redis):
        def reg(body: str) -> AsyncScript:
            return client.register_script(_PRELUDE + IMAGES_LUA + _PRELUDE_ITEMS + body)  # type: ignore[return-value]

        self.create_conversation = reg(CREATE_CONVERSATION)
        self.append_items = reg(APPEND_ITEMS)
        self.delete_item = reg(DELETE_ITEM)
        self.update_conversation = reg(UPDATE_CONVERSATION)
        self.delete_conversation = reg(DELETE_CONVERSATION)
        self.acquire_lease = reg(ACQUIRE_LEASE)
        self.renew_lease = reg(RENEW_LEASE)
        self.release_lease = reg(RELEASE_LEASE)
        self.commit_turn = reg(COMMIT_TURN)
        self.save_response = reg(SAVE_RESPONSE)
        self.delete_response = reg(DELETE_RESPONSE)
        self.list_items = reg(LIST_ITEMS)
        self.load_conversation = reg(LOAD_CONVERSATION)
        self.response_items = reg(RESPONSE_ITEMS)
        self.get_item = reg(GET_ITEM)
        self.load_chain = reg(LOAD_CHAIN)
        self.append_event = reg(APPEND_EVENT)
        self.heartbeat_job = reg(HEARTBEAT_JOB)
        self.forget_idempotency = reg(FORGET_IDEMPOTENCY)
