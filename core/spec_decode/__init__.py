"""Speculative decoding: proposers of draft tokens, their exact verification, adaptivity.

A request's drafts travel in the step description (`StepDescription.spec_token_ids`) and
are verified in the same step by the target model through the platform's ordinary ragged
attention: the row computes its last sampled token and its k drafts as one query of
1 + k tokens. `verify` keeps the longest prefix the target agrees with (greedy) or accepts
(rejection sampling), plus one token of the target's own. See docs/speculative.md.
"""

from tokenmill.spec_decode.config import SpeculativeConfig

__all__ = ["SpeculativeConfig"]
