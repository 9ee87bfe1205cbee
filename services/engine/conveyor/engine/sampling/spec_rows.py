"""The sample rows of requests with drafts (speculative decoding), and what they accept.

A request with k drafts d is sampled at k + 1 rows: row j (0 .. k) holds the logits
after its known tokens and d[:j], so it is sampled as if d[:j] were already output
(penalties, min_tokens and a seed's position see them). Requests without drafts have
one row, themselves.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from conveyor.engine.core.scheduler_output import SampledToken, ScheduledRequest


def expand(requests: Sequence[ScheduledRequest]) -> list[ScheduledRequest]:
    """One entry per row: a request without drafts as it is; with drafts, one per row."""
    if not any(r.draft_token_ids for r in requests):
        return list(requests)
    rows: list[ScheduledRequest] = []
    for r in requests:
        rows.append(r)
        drafts = r.draft_token_ids
        rows.extend(dataclasses.replace(r, output_token_ids=r.output_token_ids + drafts[:j],
                                        draft_token_ids=[])
                    for j in range(1, len(drafts) + 1))
    return rows


def accepted(per_row: list[SampledToken],
             requests: Sequence[ScheduledRequest]) -> list[list[SampledToken]]:
    """Each request's new tokens from its rows' choices: the drafts while each row chose
    its draft, then the first row's choice that differs (or, every draft accepted, the
    last row's)."""
    out: list[list[SampledToken]] = []
    row = 0
    for r in requests:
        tokens = [per_row[row]]
        for j, draft in enumerate(r.draft_token_ids):
            if tokens[-1].token_id != draft:
                break
            tokens.append(per_row[row + j + 1])
        out.append(tokens)
        row += r.num_sample_rows
    return out
