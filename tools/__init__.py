"""Structured output and tool calls: grammars, schemas, call parsing."""
