"""Constrained output: grammars from JSON schemas and regexes (llguidance), tool calls, and the
check of a finished output against the whole schema."""
