"""The prefix tier: an LMCache-backed store of KV pages and KDA checkpoints by block hash, plus an
index of which tier / which prefill instance holds each hash (Redis, or in-process)."""
