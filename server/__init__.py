"""Parrot: an OpenAI-compatible server with exact n-gram speculative decoding."""
