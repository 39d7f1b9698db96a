"""The P->D handoff: a producer (prefill worker side) that streams a request's pages and KDA state
as layers finish, and a consumer (decode worker side) that verifies and writes them into its cache.

Wire format: tandem.v1.HandoffChunk (proto/prefill.proto). Layout is canonical (full heads, token
order), so producer and consumer parallel layouts may differ.
"""
