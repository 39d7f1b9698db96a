"""The decode service (consumer): pulls a request's handoff from a prefill worker, continues decoding."""
