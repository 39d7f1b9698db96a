"""KV pages, KDA state slots, their allocators and the memory budget that sizes them."""
