"""Tandem: disaggregated prefill/decode serving. The `tandem` command lives in tandem.cli."""
