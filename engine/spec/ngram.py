"""n-gram (prompt lookup) drafter: no weights; proposes the tokens that followed the most recent
earlier occurrence of the request's current suffix."""

from __future__ import annotations

from engine.request import Request


class NgramDrafter:
    needs_aux = False

    def __init__(self, ngram_min: int = 1, ngram_max: int = 4) -> None:
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max

    def propose(self, req: Request, k: int, aux=None) -> list[int]:
        ids = req.all_token_ids
        n_tokens = len(ids)
        for n in range(min(self.ngram_max, n_tokens - 1), self.ngram_min - 1, -1):
            suffix = ids[n_tokens - n :]
            # the most recent earlier occurrence whose continuation exists
            for start in range(n_tokens - n - 1, -1, -1):
                if ids[start : start + n] == suffix:
                    follow = ids[start + n : start + n + k]
                    if follow:
                        return follow
        return []
