"""How many drafts each request proposes next: adapted to its recent acceptance.

A request whose drafts keep being rejected pays for verifying rows that are thrown away (and at
larger batch they cost real compute); one whose drafts are all accepted is leaving tokens on the
table at this length. So, per request (the heuristic of HF's assisted generation): start at
`num_speculative_tokens`, two more after a step that accepted every draft, one fewer after a step
that rejected one, between 1 and `num_speculative_tokens`. A request that proposes nothing (the
n-gram found no match) is not changed.
"""

from __future__ import annotations


class DraftLength:
    def __init__(self, max_len: int) -> None:
        self.max_len = max_len
        self._len: dict[str, int] = {}

    def limit(self, req_id: str) -> int:
        return self._len.get(req_id, self.max_len)

    def update(self, req_id: str, num_drafts: int, num_accepted: int) -> None:
        """After a verification of `num_drafts` drafts of which `num_accepted` were accepted."""
        cur = self._len.get(req_id, self.max_len)
        cur = cur + 2 if num_accepted == num_drafts else cur - 1
        self._len[req_id] = max(1, min(self.max_len, cur))

    def forget(self, req_ids: list[str]) -> None:
        for req_id in req_ids:
            self._len.pop(req_id, None)
