"""The prefill service (producer): runs prompts, streams their state to decode workers. Never speculates."""
