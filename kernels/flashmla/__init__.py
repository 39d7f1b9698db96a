"""FlashMLA's dense sm90 MLA decode, built from pinned sources (build.py) behind one adapter (decode.py)."""
