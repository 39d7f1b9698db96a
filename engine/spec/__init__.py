"""Speculative decoding (decode side only): drafters propose tokens, the target verifies them in one
step, and the KDA state rolls back to the last accepted token."""
