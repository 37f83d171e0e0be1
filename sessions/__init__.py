"""Conversation state in Redis (items, responses, events) and compaction."""
