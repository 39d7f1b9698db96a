"""The gateway: OpenAI-compatible HTTP and a gRPC API in front of prefill and decode workers."""
