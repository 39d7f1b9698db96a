"""Tandem's model runner, shared by the prefill and decode services."""
